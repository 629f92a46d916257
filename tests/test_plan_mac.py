"""``mlxkv plan --backend metal``: a Mac planned from anywhere, what would fit, the trained
context, and answers in closed form for any context."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.plan_cli import LLAMA31, LLAMA31_4BIT, plan_json, run_plan

DATA = Path(__file__).parent / "data" / "configs"
GiB = 2**30
MiB = 2**20


pytestmark = pytest.mark.usefixtures("fresh_home")


def with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with each option in ``flags`` set (replacing the same option)."""
    out = list(argv)
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name in out:
            out[out.index(name) + 1] = value
        else:
            out += [name, value]
    return out


MAC16 = ["--backend", "metal", "--memory", "16GB"]


def test_llama_31_8b_bf16_weights_and_verdict_on_a_16gb_mac(capsys):
    code, d = plan_json(capsys, LLAMA31, *MAC16, "--context", "32768")
    assert abs(d["weights_bytes"] / 16.06e9 - 1) < 0.01
    assert d["weights_bytes"] == 8_030_261_248 * 2  # every parameter in bfloat16
    assert d["kv_dtype"] == "bfloat16" and d["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert d["available_bytes"] == 16 * GiB * 2 // 3 and d["memory_total_bytes"] == 16 * GiB
    assert code == 1 and not d["fits"] and d["max_context"] == 0
    assert d["fused_attention"] and d["trained_context"] == 131_072
    assert d["wired_limit"] is None  # 20 GiB cannot fit a 16 GiB Mac, whatever the sysctl


def test_llama_31_8b_4bit_is_the_packed_size_and_holds_32k_on_16gb(capsys):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    config = json.loads(Path(LLAMA31).read_text())
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: nothing is allocated
    model.set_dtype(mx.bfloat16)
    model, _ = quantize_model(model, config, 64, 4)
    packed = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    capsys.readouterr()  # quantize_model prints its bits per weight

    code, d = plan_json(capsys, LLAMA31_4BIT, *MAC16, "--context", "32768")
    assert d["weights_bytes"] == packed  # 4,517,404,672 B
    assert code == 0 and d["fits"] and d["runnable"]
    assert d["load_wired_limit_bytes"] == packed + 2 * GiB


def test_fit_suggestions_each_replan_as_fitting(capsys):
    cases = [
        [LLAMA31, *MAC16, "--context", "32768"],  # weights alone too big
        [LLAMA31_4BIT, "--backend", "metal", "--memory", "8GB", "--context", "32768"],
        [LLAMA31_4BIT, *MAC16, "--context", "131072", "--batch", "2"],
        [str(DATA / "published" / "llama-2-7b.json"), "--backend", "cpu", "--memory", "64GB",
         "--context", "16384"],  # fits in memory, but past the trained 4,096 tokens
    ]  # fmt: skip
    for argv in cases:
        code, d = plan_json(capsys, *argv, "--fit")
        assert code == 1 and d["suggestions"], argv
        costs = [s["quality_cost"] for s in d["suggestions"]]
        measured = [c for c in costs if c is not None]
        assert measured == sorted(measured) and costs[: len(measured)] == measured
        for s in d["suggestions"]:
            again_code, again = plan_json(capsys, *with_flags(argv, s["flags"]))
            assert again_code == 0 and again["fits"], (argv, s)
            if "per_host" in again:  # --hosts N: the tightest host is the suggestion's total
                tightest = again["per_host"][again["tightest_host"]]
                assert tightest["total_bytes"] == s["total_bytes"] and tightest["fits"]
            else:
                assert again["runnable"] and again["total_bytes"] == s["total_bytes"]
            assert s["quality_note"]
        out_code = run_plan(*argv, "--fit")
        out = capsys.readouterr().out
        assert out_code == 1 and "--fit: these fit" in out
        assert len(out.splitlines()) <= 40  # one screen


def test_fit_proposes_the_fewest_hosts_that_hold_it(capsys):
    _, d = plan_json(capsys, LLAMA31, *MAC16, "--context", "32768", "--fit")
    hosts = [s for s in d["suggestions"] if s["flags"][0] == "--hosts"]
    # 2 Macs of 16 GB are 0.75 GiB short each; 3 cannot split 8 KV heads; 4 hold it.
    assert [s["flags"] for s in hosts] == [["--hosts", "4", "--shard", "tensor"]]
    assert d["suggestions"][0] == hosts[0]  # no quality cost, unlike 4-bit weights
    code, two = plan_json(capsys, LLAMA31, *MAC16, "--context", "32768", "--hosts", "2")
    assert code == 1 and not two["fits"]
    assert two["per_host"][0]["available_bytes"] == 16 * GiB * 2 // 3  # the Mac's working set


def test_fit_names_the_quality_source(capsys):
    argv = [LLAMA31_4BIT, "--backend", "metal", "--memory", "8GB", "--context", "32768", "--fit"]
    _, d = plan_json(capsys, *argv)
    window = [s for s in d["suggestions"] if "--kv-window" in s["flags"]]
    measured = [s for s in window if s["quality_cost"] is not None]
    assert measured and all("docs/cache-quality.md" in s["quality_source"] for s in measured)
    # Keys and values at different widths are not in that table: no cost, no source, last.
    for s in window:
        if s["quality_cost"] is None:
            assert s["quality_source"] is None and "not measured" in s["quality_note"]
    assert any(
        s["flags"] == ["--context", str(d["max_context"] // 256 * 256)] for s in d["suggestions"]
    )


@pytest.mark.parametrize(
    "ram_gb, working_set_mib",
    [(8, 5461), (16, 10922), (24, 16384), (32, 21845), (64, 49152), (128, 98304)],
)
def test_metal_working_set_rule(capsys, ram_gb, working_set_mib):
    """2/3 of RAM up to 36 GiB, 3/4 above (values Metal reports: mlxkv.memory.working_set)."""
    _, d = plan_json(capsys, LLAMA31_4BIT, "--backend", "metal", "--memory", f"{ram_gb}GB")
    assert d["available_bytes"] // MiB == working_set_mib
    assert d["memory_total_bytes"] == ram_gb * GiB
    assert "recommended working set" in d["available_source"]


def test_raising_the_wired_limit_is_proposed_when_it_makes_it_fit(capsys):
    argv = [LLAMA31_4BIT, "--backend", "metal", "--memory", "24GB", "--context", "100000"]
    code, d = plan_json(capsys, *argv)
    assert code == 1 and not d["fits"]
    w = d["wired_limit"]
    assert w["command"] == f"sudo sysctl iogpu.wired_limit_mb={w['limit_mb']}"
    assert w["limit_mb"] * MiB >= d["total_bytes"] > d["available_bytes"]
    assert w["limit_mb"] % 256 == 0 and w["headroom_bytes"] == 24 * GiB - w["limit_mb"] * MiB
    assert w["headroom_bytes"] >= 4 * GiB
    run_plan(*argv)
    assert "sudo sysctl iogpu.wired_limit_mb=" in capsys.readouterr().out


def test_load_wired_limit_never_exceeds_weights_plus_margin():
    from mlxkv.memory.working_set import load_wired_limit, working_set

    assert load_wired_limit(700 * MiB, working_set(16 * GiB)) == 700 * MiB + 2 * GiB
    assert load_wired_limit(15 * GiB, working_set(16 * GiB)) == working_set(16 * GiB)


def test_metal_needs_the_macs_ram_off_a_mac(capsys, monkeypatch):
    monkeypatch.setattr("sys.platform", "linux")
    assert run_plan(LLAMA31, "--backend", "metal") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory" in err
    assert run_plan(LLAMA31, "--backend", "metal", "--memory", "512MB") == 2
    assert "smaller than any Mac" in capsys.readouterr().err


def test_fused_attention_where_mlx_has_the_kernel(capsys):
    _, metal = plan_json(capsys, LLAMA31, *MAC16, "--context", "8192")
    _, cpu = plan_json(capsys, LLAMA31, "--backend", "cpu", "--memory", "64GB", "--context", "8192")
    assert metal["fused_attention"] and not cpu["fused_attention"]
    # CPU: float32 scores for one 512-token chunk over 8,192 keys, 32 heads.
    assert cpu["activation_bytes"] - metal["activation_bytes"] * 2 == 512 * 32 * 8192 * 4
    gemma = str(DATA / "published" / "gemma-3-4b-it.json")  # head dim 256: unfused on Metal
    _, g = plan_json(capsys, gemma, "--backend", "metal", "--memory", "64GB")
    assert not g["fused_attention"]


def test_any_context_is_answered_in_closed_form(capsys):
    code, d = plan_json(capsys, LLAMA31_4BIT, *MAC16, "--context", "1000000000000")
    assert code == 1 and d["kv_bytes"] == 10**12 * 131_072
    assert d["kv_bytes_allocated"] == 10**12 * 131_072  # 512-token chunks fill 256-slot steps
    assert d["past_trained_context"] and d["window_instead"]["fits"]
    w = int(d["window_instead"]["flags"][1])
    assert 0 < w < 131_072 - 4  # the trained length's window does not fit 16 GB: the largest
    argv = [LLAMA31_4BIT, *MAC16, "--context", "1000000000000"]
    again = plan_json(capsys, *with_flags(argv, d["window_instead"]["flags"]))
    assert again[0] == 0 and again[1]["total_bytes"] == d["window_instead"]["total_bytes"]
    assert d["max_context"] == plan_json(capsys, LLAMA31_4BIT, *MAC16)[1]["max_context"]


def test_prefill_in_closed_form_equals_walking_every_chunk():
    from mlxkv.memory.config import load_config
    from mlxkv.memory.predictor import KVPredictor, prefill_schedule
    from mlxkv.memory.store import layout_for
    from mlxkv.policy import KVPolicy

    rng = random.Random(7)
    policies = [KVPolicy(), KVPolicy(window=300, sinks=4), KVPolicy(bits=4, group_size=32)]
    for name in ("gemma-3-4b-it", "gpt-oss-20b", "mamba-130m", "mistral-7b-v0.1"):
        layout = layout_for(load_config(DATA / "published" / f"{name}.json"))
        for runtime in ("mlxkv", "mlx-lm"):
            for policy in policies:
                for _ in range(4):
                    tokens, chunk = rng.randint(1, 9000), rng.choice([1, 7, 256, 300, 512])
                    walked = KVPredictor(layout, policy, 2, "float16", runtime)
                    walked.snapshot()
                    for n in prefill_schedule(tokens, chunk):
                        walked.advance(n)
                    fast = KVPredictor(layout, policy, 2, "float16", runtime)
                    fast.snapshot()
                    assert fast.prefill(tokens, chunk) == walked.snapshot(), (name, tokens)


def test_trained_context_rule():
    from mlxkv.memory.context import past_trained_context, trained_context

    llama31 = json.loads(Path(LLAMA31).read_text())
    assert trained_context(llama31) == 131_072  # llama3 scaling: 8 x 8,192 is smaller
    yarn = {"max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32768}}  # fmt: skip
    assert trained_context(yarn) == 131_072
    assert trained_context({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert trained_context({}) is None
    assert past_trained_context(8192, None, 8193) and not past_trained_context(8192, None, 8192)
    assert not past_trained_context(8192, 1024, 10**6) and not past_trained_context(None, None, 9)


def test_past_the_trained_context_plan_flags_what_generate_refuses(
    default_model, tmp_path, monkeypatch, capsys
):
    """One rule (mlxkv.memory.context): a prompt + 1 reply token past the trained context."""
    import re

    from mlxkv.engine.session import GenerationSettings, Session
    from mlxkv.errors import UserError
    from mlxkv.policy import KVPolicy

    settings = GenerationSettings(max_tokens=2, temperature=0.0)
    prompt = "Tell me about the sea and the sky. " * 3
    monkeypatch.setitem(default_model.config, "max_position_embeddings", 8)
    with pytest.raises(UserError) as refused:
        list(Session(default_model, overflow="stop").run(prompt, settings))
    needed = int(re.search(r"needs (\d+) tokens", str(refused.value)).group(1))
    config = dict(default_model.config)
    for limit, refuses in ((needed, True), (needed + 1, False)):
        monkeypatch.setitem(default_model.config, "max_position_embeddings", limit)
        config["max_position_embeddings"] = limit
        (tmp_path / "config.json").write_text(json.dumps(config))
        _, d = plan_json(capsys, str(tmp_path / "config.json"), "--context", str(needed + 1))
        assert d["past_trained_context"] is refuses and d["trained_context"] == limit
        events = Session(default_model, overflow="stop").run(prompt, settings)
        if refuses:
            with pytest.raises(UserError, match=f"model's context is {limit}"):
                list(events)
            assert d["window_instead"]["flags"][:2] == ["--kv-window", str(limit - 4)]
        else:
            list(events)
    # With a window neither refuses.
    monkeypatch.setitem(default_model.config, "max_position_embeddings", needed)
    windowed = Session(default_model, policy=KVPolicy(window=needed - 4, sinks=4))
    list(windowed.run(prompt, settings))
    flags = ["--context", str(needed + 1), "--kv-window", str(needed - 4)]
    assert not plan_json(capsys, str(tmp_path / "config.json"), *flags)[1]["past_trained_context"]


def test_chart_in_the_terminal_shows_where_curves_cross_the_budget(capsys):
    argv = [LLAMA31_4BIT, *MAC16, "--context", "32768"]
    assert run_plan(*argv, "--chart") == 0
    out = capsys.readouterr().out
    _, d = plan_json(capsys, *argv)
    assert f"* this plan (full): fits up to {d['max_context']:,} tokens" in out
    assert "o sink 4 + window 4092: fits at any context" in out
    assert "- budget 10.67 GiB" in out and "4-bit KV: fits up to" in out


def test_chart_png_and_the_users_files(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    argv = [LLAMA31_4BIT, *MAC16, "--context", "32768", "--chart"]
    png = tmp_path / "memory.png"
    assert run_plan(*argv, str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart saved to {png}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "memory.png"]  # no temp file
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"user data")
    assert run_plan(*argv, str(mine)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists" in err and mine.read_bytes() == b"user data"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # not installed
    assert run_plan(*argv, str(tmp_path / "other.png")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib" in err
    assert not (tmp_path / "other.png").exists()


QUANT_FAMILIES = ["llama", "gemma3_text", "mixtral", "granitemoe", "deepseek_v3", "gpt_oss"]
RECIPES = {  # name -> (group size, bits, mixed-bit recipe of mlx_lm.convert)
    "4-bit": (64, 4, None),
    "8-bit g32": (32, 8, None),
    "mixed_3_6": (32, 3, "mixed_3_6"),
}


def _quantized_by_mlx_lm(family: str, recipe: str):
    """A tiny random model quantized by mlx_lm itself: (model, the config it writes)."""
    import contextlib
    import io

    import mlx.core as mx
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model

    from tests.tiny_models import FAMILIES, build_family

    config = FAMILIES[family]
    model = build_family(family)
    model.set_dtype(mx.bfloat16)
    group, bits, mixed = RECIPES[recipe]
    predicate = mixed_quant_predicate_builder(mixed, model, group) if mixed else None
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight
        model, qconfig = quantize_model(model, config, group, bits, quant_predicate=predicate)
    if "lm_head" in model:  # a checkpoint with a head of its own says so (Gemma 3 ties by default)
        qconfig["tie_word_embeddings"] = False
    return model, {**qconfig, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("family", QUANT_FAMILIES)
def test_packed_weights_equal_mlx_lms_own_quantization(family, recipe, tmp_path, capsys):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, qconfig = _quantized_by_mlx_lm(family, recipe)
    params = dict(tree_flatten(model.parameters()))
    expected = sum(p.nbytes for p in params.values())
    (tmp_path / "config.json").write_text(json.dumps(qconfig))
    metal = ["--backend", "metal", "--memory", "64GB"]
    _, d = plan_json(capsys, str(tmp_path / "config.json"), *metal)
    assert d["weights_bytes"] == expected, "from config.json"
    if recipe == "4-bit":  # the same from the safetensors headers of the saved model
        mx.eval(params)
        mx.save_safetensors(str(tmp_path / "model.safetensors"), params)
        _, d = plan_json(capsys, str(tmp_path), *metal)
        assert d["weights_bytes"] == expected and "safetensors" in d["weights_source"]


def test_a_gemma3_checkpoint_without_a_head_as_mlx_lm_loads_it(tmp_path, capsys):
    """Published Gemma 3 checkpoints tie the embeddings and hold no lm_head; mlx-lm builds
    one and drops it while loading. The plan from config.json alone counts what mlx-lm
    holds after loading such a checkpoint."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, qconfig = _quantized_by_mlx_lm("gemma3_text", "4-bit")
    del qconfig["tie_word_embeddings"]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(qconfig))
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_head.")}
    mx.save_safetensors(str(tmp_path / "ckpt" / "model.safetensors"), weights)
    loaded, _ = load_model(tmp_path / "ckpt")
    held = sum(p.nbytes for _, p in tree_flatten(loaded.parameters()))
    (tmp_path / "config.json").write_text(json.dumps(qconfig))
    metal = ["--backend", "metal", "--memory", "64GB"]
    _, d = plan_json(capsys, str(tmp_path / "config.json"), *metal)
    assert d["weights_bytes"] == held < sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def test_a_layer_the_config_keeps_unquantized(tmp_path, capsys):
    from mlx.utils import tree_flatten

    model, qconfig = _quantized_by_mlx_lm("llama", "4-bit")
    # What mlx_lm writes for a layer its predicate answers with False... and how it loads.
    qconfig["quantization"]["model.layers.0.mlp.down_proj"] = False
    (tmp_path / "config.json").write_text(json.dumps(qconfig))
    _, d = plan_json(capsys, str(tmp_path / "config.json"), "--backend", "metal", "--memory", "8GB")
    packed = dict(tree_flatten(model.parameters()))
    down = "layers.0.mlp.down_proj"
    w = model.layers[0].mlp.down_proj  # packed: 8 four-bit values per uint32
    dense = w.weight.shape[0] * w.weight.shape[1] * 32 // 4 * 2  # unpacked 4-bit -> bf16
    quantized = sum(packed[f"model.{down}.{k}"].nbytes for k in ("weight", "scales", "biases"))
    assert d["weights_bytes"] == sum(p.nbytes for p in packed.values()) - quantized + dense


def test_wiring_at_load_is_a_no_op_without_metal():
    import mlx.core as mx

    from mlxkv.memory.working_set import wire_for_load

    if mx.metal.is_available():
        pytest.skip("a Metal device: wire_for_load sets the limit (checked on Macs)")
    assert wire_for_load(10 * GiB) is None


def test_fit_offers_keys_4_values_2(capsys):
    argv = [LLAMA31_4BIT, *MAC16, "--context", "131072"]
    _, d = plan_json(capsys, *argv, "--fit")
    split = [s for s in d["suggestions"] if "--kv-key-bits" in s["flags"]]
    assert split and split[0]["flags"][-4:] == ["--kv-key-bits", "4", "--kv-value-bits", "2"]
    for s in split:
        code, again = plan_json(capsys, *with_flags(argv, s["flags"]))
        assert code == 0 and again["total_bytes"] == s["total_bytes"]
    run_plan(*argv, "--chart")
    assert "keys 4 / values 2" in capsys.readouterr().out


def test_bad_backend_or_weight_bits_is_one_line(capsys):
    for argv, words in (
        (["--backend", "rocm"], "--backend must be one of metal, cuda, cpu"),
        (["--backend", "metal", "--memory", "16GB", "--weight-bits", "7"], "--weight-bits"),
        (["--chart", "memory.svg"], "ending in .png"),
    ):
        assert run_plan(LLAMA31, *argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_fit_flags_added_to_a_command_with_key_and_value_widths_take_effect(capsys):
    """--kv-key-bits/--kv-value-bits override --kv-bits: a suggested --kv-bits 4 added to
    such a command changed nothing and did not fit."""
    argv = [LLAMA31, *MAC16, "--context", "40000", "--weight-bits", "4", "--batch", "2"]
    argv += ["--kv-key-bits", "8", "--kv-value-bits", "8"]
    _, d = plan_json(capsys, *argv, "--fit")
    widths = [s for s in d["suggestions"] if "--kv-value-bits" in s["flags"]]
    assert widths and not [s for s in d["suggestions"] if "--kv-bits" in s["flags"]]
    for s in [s for s in d["suggestions"] if "--hosts" not in s["flags"]]:
        code, again = plan_json(capsys, *argv, *s["flags"])  # added at the end, as typed
        assert code == 0 and again["total_bytes"] == s["total_bytes"], s["flags"]
