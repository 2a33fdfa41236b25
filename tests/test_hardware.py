"""Hardware profiles in configs/hardware and the alpha-beta fit of `autoshard profile`."""
import pytest

from autoshard.hardware import CONFIG_DIR, HardwareError, HardwareProfile, load_hardware
from autoshard.profile import ProfileError, fit_alpha_beta

PROFILES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_expected_profiles_exist():
    assert {"a100-nvlink", "h100-nvlink", "h100-multinode", "cpu-gloo"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_profile_loads_and_is_sane(name):
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.description.strip()
    assert all(link.alpha >= 0 and link.beta > 0 for link in hw.axes)
    assert hw.flops_for("float32") > 0 and hw.memory_bandwidth > 0 and hw.host_device_bandwidth > 0
    assert hw.memory_per_device > 2**30
    assert load_hardware(CONFIG_DIR / f"{name}.yaml") == hw
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


def test_multinode_outer_axis_is_slower():
    hw = load_hardware("h100-multinode")
    assert hw.axes[0].beta > hw.axes[1].beta and hw.axes[0].alpha > hw.axes[1].alpha


def test_unknown_name_lists_known_profiles():
    with pytest.raises(HardwareError, match=r"unknown hardware profile 'tpu-v9'.*h100-nvlink"):
        load_hardware("tpu-v9")


def test_missing_field_is_named():
    d = load_hardware("h100-nvlink").to_dict()
    del d["memory_bandwidth"]
    with pytest.raises(HardwareError, match="memory_bandwidth"):
        HardwareProfile.from_dict(d)


# -- fitting measured all-reduce times ----------------------------------------------------------------
SIZES = [4096 * 4**k for k in range(7)]


def ring_all_reduce(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_exact_alpha_beta(n):
    times = [ring_all_reduce(b, n, 3e-5, 2e-10) for b in SIZES]
    link = fit_alpha_beta(SIZES, times, n)
    assert link.alpha == pytest.approx(3e-5, rel=1e-9)
    assert link.beta == pytest.approx(2e-10, rel=1e-9)


def test_fit_tolerates_noise_and_clamps_negative_latency():
    noisy = [ring_all_reduce(b, 2, 1e-4, 1e-9) * (1.1 if i % 2 else 0.9) for i, b in enumerate(SIZES)]
    link = fit_alpha_beta(SIZES, noisy, 2)
    assert link.alpha == pytest.approx(1e-4, rel=0.2) and link.beta == pytest.approx(1e-9, rel=0.2)
    # pure bandwidth with a tiny dip at small sizes would fit a negative intercept: clamp to 0
    dipped = [ring_all_reduce(b, 2, 0.0, 1e-9) - (1e-7 if b < 10**5 else 0) for b in SIZES]
    link = fit_alpha_beta(SIZES, dipped, 2)
    assert link.alpha == 0.0 and link.beta == pytest.approx(1e-9, rel=0.05)


def test_fit_rejects_unusable_data():
    with pytest.raises(ProfileError, match="two or more distinct"):
        fit_alpha_beta([4096, 4096], [1e-3, 1e-3], 2)
    with pytest.raises(ProfileError, match="does not grow"):
        fit_alpha_beta(SIZES, [1e-3 - 1e-12 * b for b in SIZES], 2)
    with pytest.raises(ProfileError, match="no communication"):
        fit_alpha_beta(SIZES, [1e-3] * len(SIZES), 1)


def test_device_memory_separate_only_on_gpu_profiles():
    assert not load_hardware("cpu-gloo").device_memory_separate
    for name in ("a100-nvlink", "h100-nvlink", "h100-multinode"):
        assert load_hardware(name).device_memory_separate


def test_device_memory_separate_defaults_true_and_must_be_a_bool():
    d = load_hardware("cpu-gloo").to_dict()
    assert d["device_memory_separate"] is False
    del d["device_memory_separate"]               # profiles (and plans) written before the field
    assert HardwareProfile.from_dict(d).device_memory_separate is True
    d["device_memory_separate"] = "false"
    with pytest.raises(HardwareError, match="device_memory_separate must be true or false"):
        HardwareProfile.from_dict(d)
