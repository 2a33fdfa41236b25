"""Time capture of the Llama-2-7B preset (32 layers, hidden 4096) on meta, batch 8, seq 2048.

Each repetition builds the model on meta afresh and captures it; the table reports medians of
torch.export time, autoshard's post-processing time (annotation) and their sum, plus the
fingerprint time. Model construction is reported apart: the first one also imports the
transformers Llama code.
Run: python bench/capture_llama7b.py [--reps 3]
"""
from __future__ import annotations

import argparse
import time

import transformers
from _common import median, write

from autoshard.capture import capture
from autoshard.models import build_model

MODEL, BATCH, SEQ = "llama-7b", 8, 2048


def one_run() -> dict:
    start = time.perf_counter()
    model, args, kwargs = build_model(MODEL, device="meta", batch=BATCH, seq=SEQ)
    built = time.perf_counter()
    graph = capture(model, args, kwargs, name=MODEL)
    fp_start = time.perf_counter()
    graph.fingerprint()
    return {"build_s": built - start, "export_s": graph.timings["export_s"],
            "postprocess_s": graph.timings["postprocess_s"],
            "total_s": graph.timings["export_s"] + graph.timings["postprocess_s"],
            "fingerprint_s": time.perf_counter() - fp_start,
            "nodes": len(graph.graph.nodes), "ops": sum(1 for _ in graph.nodes()),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    reps = parser.parse_args().reps
    runs = [one_run() for _ in range(reps)]
    for i, r in enumerate(runs):
        print(f"run {i}: build {r['build_s']:.2f} s, export {r['export_s']:.2f} s, "
              f"post {r['postprocess_s']:.3f} s, fingerprint {r['fingerprint_s']:.3f} s")
    med = {k: median([r[k] for r in runs]) for k in
           ("build_s", "export_s", "postprocess_s", "total_s", "fingerprint_s")}
    nodes, ops = runs[0]["nodes"], runs[0]["ops"]
    data = {"model": MODEL, "device": "meta", "batch": BATCH, "seq": SEQ, "reps": reps,
            "params": runs[0]["params"], "nodes": nodes, "call_function_nodes": ops,
            "median": med, "runs": runs, "transformers": transformers.__version__}
    header = ["model", "nodes (ops)", "export s", "post-processing s", "total s", "fingerprint s"]
    row = [f"{MODEL} b{BATCH} s{SEQ} (meta)", f"{nodes} ({ops})", f"{med['export_s']:.2f}",
           f"{med['postprocess_s']:.3f}", f"{med['total_s']:.2f}", f"{med['fingerprint_s']:.3f}"]
    note = (f"Median of {reps} runs. total = export + post-processing (what `capture` costs); "
            f"building the model on meta took a median {med['build_s']:.2f} s more "
            f"(the first build {runs[0]['build_s']:.2f} s, including imports).")
    write("capture_llama7b", data, header, [row], note)


if __name__ == "__main__":
    main()
