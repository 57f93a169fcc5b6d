"""bench/gpu.py --smoke: every section runs on the CPU, and what it reports is what it
measured (a GPU-only part says it was skipped)."""

import dataclasses
import importlib.util
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import count_params
from jaxformer.moe.grouped_matmul import GROUPED_MATMULS
from tests.conftest import REPO

pytestmark = pytest.mark.heavy  # run first: tests/conftest.py


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = gpu  # its dataclasses look their module up
    spec.loader.exec_module(gpu)
    # one batch of 2 for decoding and serving (a row's batch factor still shows), and one
    # timed repeat: each program compiled once is what the rows' checks need
    gpu.SMOKE = dataclasses.replace(gpu.SMOKE, decode_batches=(2,), serve_batches=(2,))
    out = tmp_path_factory.mktemp("gpu")
    return gpu, out, gpu.main(["--smoke", "--repeats", "1", "--out", str(out)])


def test_writes_json_and_markdown_of_every_section(smoke):
    gpu, out, res = smoke
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(res))
    md = (out / "results.md").read_text()
    for section in ("## Attention", "## cuDNN tests", "## Train step (", "## Decode",
                    "## Serving engine", "## Train step by matmul precision", "## Chunked loss",
                    "## MoE train step", "## MLA", "## Decode step profile"):
        assert section in md
    assert set(gpu.SECTIONS) <= set(res)


def test_attention_backends_agree_with_the_float32_reference(smoke):
    gpu, _, res = smoke
    cells = {(r["mask"], r["impl"]): r for r in res["attention"]}
    assert set(cells) == {(m, i) for m in gpu.MASK_KINDS for i in gpu.ATTENTION_IMPLS}
    for (mask, impl), r in cells.items():
        if impl == "cudnn":
            assert r["status"] == gpu.NO_GPU  # the suite's CPU
            continue
        assert r["status"] == "ok", (mask, impl, r["status"])
        # bf16 inputs against float32 ones: about 2^-8 relative per input, never O(1)
        assert 0 < r["max_err"] < 4e-2, (mask, impl, r["max_err"])
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
    assert res["tests"] == {"status": gpu.NO_GPU}


def test_train_rows_report_consistent_throughput_and_a_fresh_models_loss(smoke):
    gpu, _, res = smoke
    assert [r["model"] for r in res["train"]] == ["gpt2-small", "gpu_1b"]
    peak = res["device"]["matmul_bf16_flops_measured"]
    for r in res["train"]:
        assert r.get("status", "ok") == "ok", r
        assert math.isclose(r["tokens_per_s"], r["batch"] * r["seq"] / (r["step_ms"] / 1e3))
        assert math.isclose(r["mfu_measured"], r["model_tflops"] * 1e12 / peak)
        assert r["mfu_datasheet"] is None  # no data-sheet peak for a CPU
        # vocab 256, near-uniform logits at init: the loss is close to ln 256
        assert abs(r["loss"] - math.log(256)) < 0.5, r["loss"]


def test_decode_roofline_is_param_and_cache_bytes_over_bandwidth(smoke):
    gpu, _, res = smoke
    _, cfg, _ = gpu.train_models(gpu.SMOKE)[1]
    bandwidth = res["device"]["copy_bytes_per_s_measured"]
    for r in res["decode"]:
        tokens = r["prompt"] + r["new_tokens"]
        cache = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * 2 * r["batch"]
        assert r["bytes_per_step"] == count_params(cfg) * 2 + cache  # bf16: 2 bytes each
        assert math.isclose(r["roofline_tokens_per_s"],
                            r["batch"] * bandwidth / r["bytes_per_step"])
        assert math.isclose(r["of_roofline"], r["tokens_per_s"] / r["roofline_tokens_per_s"])


def test_serve_rows_make_every_token_against_the_decode_roofline(smoke):
    """The engine's rows: every sequence made its new tokens, and the roofline is the
    decode section's (param and cache bytes over bandwidth) at the same batch."""
    gpu, _, res = smoke
    _, cfg, _ = gpu.train_models(gpu.SMOKE)[1]
    bandwidth = res["device"]["copy_bytes_per_s_measured"]
    assert [r["sequences"] for r in res["serve"]] == list(gpu.SMOKE.serve_batches)
    for r in res["serve"]:
        assert r["tokens_made"] == r["sequences"] * r["new_tokens"]
        tokens = r["prompt"] + r["new_tokens"]
        cache = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * 2 * r["sequences"]
        assert r["bytes_per_step"] == count_params(cfg) * 2 + cache
        assert math.isclose(r["roofline_tokens_per_s"],
                            r["sequences"] * bandwidth / r["bytes_per_step"])
        assert math.isclose(r["of_roofline"], r["tokens_per_s"] / r["roofline_tokens_per_s"])


def test_decode_profile_counts_the_traced_calls_ops(smoke):
    """The traced generate's ops on the CPU (its host threads): each step runs ops, they are
    busy within their span and the span within the call; the top ops are ranked by time."""
    gpu, _, res = smoke
    [r] = res["decode_profile"]
    assert r.get("status", "ok") == "ok", r
    assert (r["op_source"], r["steps"], r["batch"]) == ("host threads", gpu.SMOKE.new_tokens, 1)
    _, cfg, _ = gpu.train_models(gpu.SMOKE)[1]
    assert r["ops_per_step"] >= cfg.n_layers  # a matmul per layer at the least
    assert 0 < r["busy_ms_per_step"] <= r["span_ms_per_step"] <= r["traced_wall_ms_per_step"]
    assert r["untraced_wall_ms_per_step"] > 0
    assert math.isclose(r["idle_share"], 1 - r["busy_ms_per_step"] / r["span_ms_per_step"])
    times = [o["ms_per_step"] for o in r["top_ops"]]
    assert times == sorted(times, reverse=True) and len(times) == 8
    for o in r["top_ops"]:
        assert math.isclose(o["share_of_busy"], o["ms_per_step"] / r["busy_ms_per_step"])


def _timeline(rng, pid, tid, n, name="fusion"):
    """n complete events on (pid, tid) at random integer microseconds, overlapping."""
    starts = np.sort(rng.integers(0, 5_000, n))
    return [{"ph": "X", "pid": pid, "tid": tid, "ts": int(t), "dur": int(d),
             "name": f"{name}.{i}"} for i, (t, d) in enumerate(zip(starts,
                                                                   rng.integers(1, 300, n)))]


def test_step_profile_takes_a_devices_ops_and_their_union(smoke, rng):
    """A GPU-shaped trace (XLA Ops and Stream lines on /device:GPU:0, events on the host
    too): the ops are the device's XLA Ops line (else its streams' kernels, their copies
    counted apart, else the host's events named as HLO instructions where the host runs
    them), busy time is their intervals' union (against a microsecond grid), and the idle
    share is the rest of their span."""
    gpu, _, _ = smoke
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}}] + [
        {"ph": "M", "name": "thread_name", "pid": p, "tid": t, "args": {"name": n}}
        for p, t, n in ((1, 1, "XLA Ops"), (1, 2, "Stream #7(Compute)"), (1, 3, "XLA Modules"),
                        (9, 4, "python"))]
    ops, kernels = _timeline(rng, 1, 1, 40), _timeline(rng, 1, 2, 60, "loop_fusion")
    copy = {"ph": "X", "pid": 1, "tid": 2, "ts": 9_500, "dur": 400, "name": "MemcpyD2H"}
    host = _timeline(rng, 9, 4, 30, "copy") + [
        {"ph": "X", "pid": 9, "tid": 4, "ts": 0, "dur": 9_000, "name": n}
        for n in ("while.3", "$generate", "Handle inputs")]
    module = [{"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 9_000, "name": "jit_run"}]
    base = meta + module + host
    for extra, events, source in ((ops + kernels, ops, "device XLA Ops"),
                                  (kernels + [copy], kernels, "device streams"),
                                  ([], host[:-3], "host threads")):
        grid = np.zeros(10_000, bool)
        for e in events:
            grid[e["ts"]:e["ts"] + e["dur"]] = True
        covered = np.flatnonzero(grid)
        span = covered[-1] + 1 - covered[0]
        got = gpu.step_profile(base + extra, steps=4)
        assert got["op_source"] == source
        assert got["ops_per_step"] == len(events) / 4
        assert math.isclose(got["busy_ms_per_step"], grid.sum() / 4 / 1e3)
        assert math.isclose(got["span_ms_per_step"], span / 4 / 1e3)
        assert math.isclose(got["idle_share"], 1 - grid.sum() / span)
        assert got["copies_per_step"] == (0.25 if source == "device streams" else 0)
    # a GPU whose trace holds no device events: no host events stand in for its ops
    assert gpu.step_profile(base, steps=4, host_ok=False) == {
        "status": "no op events in the trace (no device events)",
        "op_source": "no device events"}


def test_unknown_section_is_refused(smoke, capsys):
    gpu, _, _ = smoke
    with pytest.raises(SystemExit):
        gpu.main(["--smoke", "--sections", "attention,speed"])
    assert "unknown section(s) speed; sections are: attention, tests, train, decode, " \
        "serve, precision, loss_chunk, moe, mla_decode, decode_profile" in capsys.readouterr().err


def test_precision_rows_train_the_same_stream_to_the_same_loss(smoke):
    """bf16, fp8, fp8_rowwise and int8 from one init on one batch stream: every row ran,
    its speed-up is its tokens/s over bf16's, and the quantised losses sit beside bf16's
    near ln 256."""
    gpu, _, res = smoke
    rows = res["precision"]
    assert [r["precision"] for r in rows] == list(gpu.SMOKE.precisions)
    for r in rows:
        assert r.get("status", "ok") == "ok", r
        assert math.isclose(r["tokens_per_s"], r["batch"] * r["seq"] / (r["step_ms"] / 1e3))
        assert math.isclose(r["speedup"], r["tokens_per_s"] / rows[0]["tokens_per_s"])
        assert r["steps"] == gpu.SMOKE.precision_steps
        assert abs(r["loss"] - math.log(256)) < 0.5, r["loss"]
        assert abs(r["loss"] - rows[0]["loss"]) < 0.05, (r["precision"], r["loss"])
    # ... yet not bf16's numbers: the quantised matmuls round otherwise
    assert all(r["loss"] != rows[0]["loss"] for r in rows[1:]), [r["loss"] for r in rows]


def test_chunked_loss_rows_agree_with_the_plain_loss(smoke):
    """Chunk 0 and N on the same batch from the same init give the same loss, the chunked
    step's peak is below the plain one's by most of the logits, and the peak ratio and
    the logits' bytes are what the rows' sizes say."""
    gpu, _, res = smoke
    rows = res["loss_chunk"]
    assert [r["chunk"] for r in rows] == list(gpu.SMOKE.loss_chunks)
    for r in rows:
        assert r.get("status", "ok") == "ok", r
        assert r["vocab"] == gpu.SMOKE.chunk_vocab and r["seq"] == gpu.SMOKE.chunk_seq
        assert math.isclose(r["logits_gib"], r["batch"] * r["seq"] * r["vocab"] * 4 / 2**30)
        assert math.isclose(r["peak_of_plain"],
                            r["step_gib_compiled"] / rows[0]["step_gib_compiled"])
        assert abs(r["loss"] - rows[0]["loss"]) < 1e-3, (r["chunk"], r["loss"])
        assert abs(r["loss"] - math.log(r["vocab"])) < 1.0
    # the chunked step no longer holds the [B, T, V] float32 logits: at least half of
    # their bytes saved (smoke's vocabulary is large beside its model for that)
    for r in rows[1:]:
        assert r["step_gib_compiled"] < rows[0]["step_gib_compiled"] - r["logits_gib"] / 2, r


def test_moe_rows_count_active_parameters_and_check_grouped_matmuls(smoke):
    """Each shape's active parameters counted here from its config (attention, router,
    top_k experts, LM head), MFU on them, every grouped matmul within bf16 rounding of the
    float64 reference, and ragged_dot run on bf16 and float8 operands."""
    gpu, _, res = smoke
    assert [r["model"] for r in res["moe"]] == list(gpu.MOE_SHAPES)
    peak = res["device"]["matmul_bf16_flops_measured"]
    for r in res["moe"]:
        assert r.get("status", "ok") == "ok", r
        cfg = gpu.moe_config(r["model"], gpu.SMOKE)
        d, hd = cfg.d_model, cfg.head_dim
        layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + d * r["experts"] + \
            3 * d * r["top_k"] * r["expert_d_ff"]
        assert r["active_params"] == cfg.n_layers * layer + d * cfg.vocab_size
        assert r["active_params"] < r["params"] == count_params(cfg)
        assert math.isclose(r["mfu_measured"], r["model_tflops"] * 1e12 / peak)
        assert set(r["grouped_max_err"]) == set(GROUPED_MATMULS)
        for impl, err in r["grouped_max_err"].items():
            assert 0 < err < 1.5e-2, (r["model"], impl, err)  # bf16 outputs: ~2^-8
        # ragged_dot on bf16 and float8 operands, float32 results: exact products summed in
        # float32 against float64 of the same values; FLOP/s from the grouped matmul's size
        rows = gpu.SMOKE.moe_check_rows
        assert set(r["ragged_dot_operands"]) == {"bf16", "fp8_e4m3"}
        for name, o in r["ragged_dot_operands"].items():
            assert o.get("status", "ok") == "ok", (name, o)
            assert isinstance(o["in_matmul"], bool)
            assert o["max_err"] < 1e-5, (r["model"], name, o["max_err"])
            assert math.isclose(o["tflops"] * 1e12 * o["ms"] / 1e3,
                                2 * rows * cfg.d_model * r["expert_d_ff"])


def test_operands_reach_a_matmul_reads_the_compiled_operands(smoke):
    """A dot's float32 operands are seen as the dot's, and bf16 ones converted to float32
    before it are not (the question the ragged_dot rows ask of float8 on a device)."""
    gpu, _, _ = smoke
    x, w = jnp.ones((8, 4)), jnp.ones((4, 3))
    assert gpu.operands_reach_a_matmul(jax.jit(jnp.dot), (x, w), jnp.float32)
    assert not gpu.operands_reach_a_matmul(jax.jit(jnp.dot), (x, w), jnp.bfloat16)
    widened = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    half = (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not gpu.operands_reach_a_matmul(widened, half, jnp.bfloat16)
    assert gpu.operands_reach_a_matmul(widened, half, jnp.float32)


def test_mla_decode_rows_hold_the_latent_cache(smoke):
    """MLA and GQA at the 1B config's width and depth; MLA's cache is its latent and rotary
    key per token and layer, GQA's its K/V heads;
    ms per step and the roofline fraction follow from the measured tokens/s."""
    gpu, _, res = smoke
    rows = res["mla_decode"]
    want = [(m, b) for m in ("gqa", "mla") for b in gpu.SMOKE.mla_batches]
    assert [(r["model"], r["batch"]) for r in rows] == want
    cfgs = gpu.attention_models(gpu.SMOKE)
    _, base, _ = gpu.train_models(gpu.SMOKE)[1]
    for r in rows:  # the same size: the 1B config's width and depth, MLA's attention
        assert (r["d_model"], r["n_layers"]) == (base.d_model, base.n_layers), r
        assert cfgs[r["model"]].mla.on == (r["model"] == "mla")
        assert r.get("status", "ok") == "ok", r
        c, tokens = cfgs[r["model"]], r["prompt"] + r["new_tokens"]
        width = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim if c.mla.on else \
            2 * c.n_kv_heads * c.head_dim
        assert r["cache_bytes"] == c.n_layers * width * tokens * 2 * r["batch"]  # bf16
        assert r["bytes_per_step"] == count_params(c) * 2 + r["cache_bytes"]
        assert math.isclose(r["ms_per_step"] / 1e3,
                            r["batch"] / r["tokens_per_s"])
        assert math.isclose(r["of_roofline"], r["tokens_per_s"] / r["roofline_tokens_per_s"])
