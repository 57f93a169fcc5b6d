"""The GPU suite: attention backends, the train step and decoding, measured in one command.

    python bench/gpu.py [--out DIR] [--smoke] [--sections attention,tests,train,decode,serve,
        precision,loss_chunk,moe,mla_decode,decode_profile]
        [--batch N] [--repeats N] [--masks causal,alibi,...] [--seqs 2048,8192]

1. attention: cuDNN vs XLA vs the reference in bf16 on every mask kind (causal, padding,
   packed, window, alibi, gqa): max error against the float32 reference, forward and
   forward+backward ms at T = 2,048 and 8,192, as the model calls it (is_causal + mask).
2. tests: tests/attention/'s cuDNN tests.
3. train: the jitted train step of gpt2-small (T 1,024) and configs/gpu_1b.yaml (T 2,048),
   bf16 compute, float32 params, scanned layers, remat none / dots / full, at the largest
   power-of-two batch the compiler says fits in 90% of device memory (or --batch):
   tokens/s, model TFLOP/s, MFU against the data-sheet bf16 peak and against a matmul
   measured in the same run, the step's memory (compiled) and compile seconds.
4. decode: generate() on the 1B config with bf16 params and cache at batch 1 and 64,
   against the memory roofline: (param bytes + KV cache bytes) read per step over a
   copy bandwidth measured in the same run.
5. serve: the serving engine (jaxformer.serve.Engine) on the same config at 1, 16 and 64
   concurrent sequences: tokens/s and its fraction of the same roofline.
6. precision: the 1B train step (T 2,048, remat dots, one fixed batch) at
   model.matmul_precision bf16 (the baseline), fp8, fp8_rowwise and int8: tokens/s, MFU,
   the loss after 20 steps on one learnable batch stream, and each one's speed over bf16's.
7. loss_chunk: the 1B train step at vocab 152,064 and T 4,096 with model.loss_chunk 0 (the
   plain loss) and 256: the compiled step's peak memory, tokens/s.
8. moe: the train step of a Mixtral-shaped and a Qwen3-MoE-shaped model that fit one GPU
   (dropless, ragged_dot): tokens/s, MFU on the active parameters; ragged_dot and tiles
   checked against a float64 reference of the grouped matmul, forward and gradients.
9. mla_decode: generate() of the 1B config with MLA (absorbed, latent cache) against its
   GQA at batch 1 and 64: ms per step, cache bytes, fraction of the memory roofline.
10. decode_profile: one generate() of section 4's model at batch 1 under jax.profiler: per
   step, the ops run, the time the device was busy with them and the share of the step
   with none running (what lies between section 4 and the roofline), and the top ops.

Writes DIR/results.json and DIR/results.md (default DIR: bench/results/<device>) and
prints the tables. --smoke runs every section at tiny sizes on whatever backend is there
(CPU: seconds); a GPU-only part then says "skipped: no GPU". Asserts nothing. The
sections are separate so that a run can be split across shorter jobs. Each stage is a
module of bench/gpu_suite/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

# the stages, and the names the tests read here
from gpu_suite.backends import (ATTENTION_IMPLS, MASK_KINDS, attention_rows,  # noqa: E402, F401
                                cudnn_tests)
from gpu_suite.decode_profile import decode_profile_rows, step_profile  # noqa: E402, F401
from gpu_suite.decoding import decode_rows  # noqa: E402
from gpu_suite.device import device_info  # noqa: E402
from gpu_suite.loss_chunk import chunk_rows  # noqa: E402
from gpu_suite.mla_decode import attention_models, mla_decode_rows  # noqa: E402, F401
from gpu_suite.moe import (MOE_SHAPES, moe_config, moe_rows,  # noqa: E402, F401
                           operands_reach_a_matmul)
from gpu_suite.precision import precision_rows  # noqa: E402
from gpu_suite.report import markdown  # noqa: E402
from gpu_suite.serving import serve_rows  # noqa: E402
from gpu_suite.sizes import NO_GPU, SMOKE, Sizes  # noqa: E402, F401
from gpu_suite.train_step import train_models, train_rows  # noqa: E402, F401

# the sections, in the order they run: each one's rows of (the command line, Sizes, masks,
# repeats, the device's info, the peak FLOP/s)
SECTIONS = {
    "attention": lambda a, sizes, masks, repeats, d, peaks: attention_rows(sizes, repeats, masks),
    "tests": lambda a, sizes, masks, repeats, d, peaks: cudnn_tests(REPO),
    "train": lambda a, sizes, masks, repeats, d, peaks: train_rows(sizes, a.batch, peaks),
    "decode": lambda a, sizes, masks, repeats, d, peaks: decode_rows(
        sizes, d["copy_bytes_per_s_measured"], repeats),
    "serve": lambda a, sizes, masks, repeats, d, peaks: serve_rows(
        sizes, d["copy_bytes_per_s_measured"], repeats),
    "precision": lambda a, sizes, masks, repeats, d, peaks: precision_rows(sizes, a.batch, peaks),
    "loss_chunk": lambda a, sizes, masks, repeats, d, peaks: chunk_rows(sizes),
    "moe": lambda a, sizes, masks, repeats, d, peaks: moe_rows(sizes, a.batch, peaks, repeats),
    "mla_decode": lambda a, sizes, masks, repeats, d, peaks: mla_decode_rows(
        sizes, d["copy_bytes_per_s_measured"], repeats),
    "decode_profile": lambda a, sizes, masks, repeats, d, peaks: decode_profile_rows(
        sizes, repeats),
}


def parsed(argv=None):
    """(the arguments, Sizes, masks, repeats) of a command line, checked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any backend, seconds")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--batch", type=int, default=None, help="train batch (default: the largest "
                   "that fits)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--masks", default=",".join(MASK_KINDS), help="attention's mask kinds")
    p.add_argument("--seqs", default=None, help="attention's lengths, e.g. 8192")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = sorted(set(a.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; sections are: {', '.join(SECTIONS)}")
    sizes = SMOKE if a.smoke else Sizes()
    masks = [m.strip() for m in a.masks.split(",") if m.strip()]
    if set(masks) - set(MASK_KINDS):
        p.error(f"unknown mask kind(s) in --masks; they are: {', '.join(MASK_KINDS)}")
    if a.seqs:
        sizes = dataclasses.replace(sizes, attn_seqs=tuple(int(t) for t in a.seqs.split(",")))
    return a, sizes, masks, a.repeats or (2 if a.smoke else 10)


def main(argv=None) -> dict:
    a, sizes, masks, repeats = parsed(argv)
    res = {"smoke": a.smoke, "device": device_info(sizes, repeats)}
    d = res["device"]
    peaks = {"datasheet": d["peak_bf16_flops_datasheet"],
             "measured": d["matmul_bf16_flops_measured"]}
    for name, rows in SECTIONS.items():
        if name in a.sections:
            res[name] = rows(a, sizes, masks, repeats, d, peaks)

    out = pathlib.Path(a.out or REPO / "bench" / "results" /
                       d["device_kind"].replace(" ", "_").replace("/", "_"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "results.md").write_text(md)
    print(md)
    print(f"written: {out / 'results.json'}, {out / 'results.md'}")
    return res


if __name__ == "__main__":
    main()
