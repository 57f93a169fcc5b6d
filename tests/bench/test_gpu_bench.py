"""bench/gpu.py --smoke: every section runs on the CPU, and what it reports is what it
measured (a GPU-only part says it was skipped)."""

import importlib.util
import json
import math
import sys

import pytest

from jaxformer import count_params
from tests.conftest import REPO


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = gpu  # its dataclasses look their module up
    spec.loader.exec_module(gpu)
    out = tmp_path_factory.mktemp("gpu")
    return gpu, out, gpu.main(["--smoke", "--out", str(out)])


def test_writes_json_and_markdown_of_every_section(smoke):
    gpu, out, res = smoke
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(res))
    md = (out / "results.md").read_text()
    for section in ("## Attention", "## cuDNN tests", "## Train step", "## Decode",
                    "## Serving engine"):
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
        assert math.isclose(r["of_roofline"], r["tokens_per_s"] / r["roofline_tokens_per_s"])


def test_unknown_section_is_refused(smoke, capsys):
    gpu, _, _ = smoke
    with pytest.raises(SystemExit):
        gpu.main(["--smoke", "--sections", "attention,speed"])
    assert "unknown section(s) speed; sections are: attention, tests, train, decode, " \
        "serve" in \
        capsys.readouterr().err
