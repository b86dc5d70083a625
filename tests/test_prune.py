"""Structured pruning (MLP channels, attention KV groups), its GAC selection and save/load, on tiny random HF models."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

from netgain.align import load, save
from netgain.align.prune import ChannelUnit, HeadUnit, PrunedLinear, Pruner, parse_layers
from netgain.align.units import aligned_fraction, full_sizes, proposed_sizes, total_params
from netgain.cost.kernels import AnalyticCost

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8, vocab_size=128)
CONFIGS = {
    "llama": LlamaConfig(num_key_value_heads=4, head_dim=8, **COMMON),
    "qwen2": Qwen2Config(num_key_value_heads=2, **COMMON),  # q/k/v biases
    "gemma3": Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=16, **COMMON),
}


def tiny(arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[arch])).eval()
    if arch == "qwen2":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_()
    return model


def batches(n=3, length=24):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, length), generator=g) for _ in range(n)]


def fitted(arch, **options):
    model = tiny(arch)
    pruner = Pruner(**options)
    pruner.fit(model, batches())
    return model, pruner


@torch.no_grad()
def masked(model, pruner, sizes):
    """A dense copy with the pruned channels' down_proj columns and the pruned query heads' o_proj columns zeroed."""
    dense = copy.deepcopy(model)
    for name, size in sizes.items():
        s = pruner.shapes[name]
        dropped = pruner.order(name)[size // s["item"] :]
        block = dense.get_submodule(name)
        if s["kind"] == "channels":
            block.down_proj.weight[:, dropped] = 0
        else:
            columns = (dropped[:, None] * s["item"] + torch.arange(s["item"])[None, :]).reshape(-1)
            block.o_proj.weight[:, columns] = 0
    return dense


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_pruned_logits_equal_the_masked_dense_model(arch):
    model, pruner = fitted(arch)
    units = pruner.propose(0.7)
    sizes = proposed_sizes(units)
    assert any(isinstance(u, HeadUnit) and u.proposed < u.full for u in units)
    assert any(isinstance(u, ChannelUnit) and u.proposed < u.full for u in units)
    sizes["model.layers.1.mlp"] = 101  # an odd width too
    pruned = copy.deepcopy(model)
    pruner.apply(pruned, sizes)
    ids = batches(1, 20)[0]
    with torch.no_grad():
        assert torch.allclose(pruned(ids).logits, masked(model, pruner, sizes)(ids).logits, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_gqa_layout_stays_valid_and_the_kv_cache_works(arch):
    model, pruner = fitted(arch)
    pruner.apply(model, proposed_sizes(pruner.propose(0.6)))
    for layer in model.model.layers:
        attn = layer.self_attn
        kv = attn.k_proj.out_features
        assert kv == attn.v_proj.out_features and kv % attn.head_dim == 0
        assert attn.q_proj.out_features == kv * attn.num_key_value_groups == attn.o_proj.in_features
    ids = batches(1, 12)[0]
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
    assert torch.allclose(full, step, atol=1e-5)


def test_one_kv_head_keeps_attention_whole_and_counts_it_in_the_ratio():
    config = Gemma3TextConfig(num_key_value_heads=1, head_dim=16, sliding_window=16, **COMMON)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    pruner = Pruner()
    pruner.fit(model, batches())
    units = pruner.propose(0.85)
    assert all(isinstance(u, ChannelUnit) for u in units)
    linears = sum(p.numel() for l in model.model.layers for m in (l.self_attn, l.mlp) for p in m.parameters() if p.dim() == 2)
    kept = pruner.fixed_params + total_params(units, proposed_sizes(units))
    assert 0.84 * linears < kept <= 0.85 * linears


def test_uniform_scope_keeps_the_same_fraction_and_layer_range_is_respected():
    _, pruner = fitted("llama", layers=range(1, 2), heads=False)
    units = {u.name: u for u in pruner.propose(0.8)}
    assert units["model.layers.0.mlp"].proposed == 160
    assert units["model.layers.1.mlp"].proposed < 160
    assert not any(isinstance(u, HeadUnit) for u in units.values())


def test_magnitude_importance_drops_zeroed_channels_first():
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[:5] = 0
        model.model.layers[0].mlp.up_proj.weight[:5] = 0
        model.model.layers[0].mlp.down_proj.weight[:, :5] = 0
    pruner = Pruner(importance="magnitude", heads=False)
    pruner.fit(model, [])
    assert set(pruner.order("model.layers.0.mlp")[-5:].tolist()) == set(range(5))


def test_gac_and_rounding_are_aligned_and_within_budget():
    _, pruner = fitted("llama", scope="global")
    units = pruner.propose(0.75)
    budget = total_params(units, proposed_sizes(units))
    channels = [u for u in units if isinstance(u, ChannelUnit)]
    for sizes in (pruner.select(units, AnalyticCost("a100"), 512), pruner.round_sizes(units, 8, "down")):
        assert total_params(units, sizes) <= budget
        assert aligned_fraction(channels, sizes, 8) == 1.0
        assert all(sizes[u.name] == u.proposed for u in units if isinstance(u, HeadUnit))
    assert aligned_fraction(units, full_sizes(units), 8) == 1.0


def test_gac_values_an_mlp_width_by_the_salience_it_prunes():
    _, pruner = fitted("llama", scope="global")
    unit = next(u for u in pruner.propose(0.75) if isinstance(u, ChannelUnit) and 8 <= u.proposed <= u.full - 8)
    ordered = torch.sort(pruner.salience[unit.name], descending=True).values
    assert unit.gain(unit.proposed + 8) == pytest.approx(ordered[unit.proposed : unit.proposed + 8].sum().item())
    assert unit.gain(unit.proposed - 8) == pytest.approx(-ordered[unit.proposed - 8 : unit.proposed].sum().item())
    assert unit.gain(unit.full) == pytest.approx(ordered[unit.proposed :].sum().item())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_save_load_round_trip_gives_identical_logits(arch, tmp_path):
    model, pruner = fitted(arch, scope="global")
    sizes = proposed_sizes(pruner.propose(0.7))
    pruner.apply(model, sizes)
    save(model, tmp_path / "out", method="prune", sizes=sizes)
    reloaded = load(tmp_path / "out")
    assert any(isinstance(m, PrunedLinear) for m in reloaded.modules())
    ids = batches(1, 20)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_bad_arguments():
    with pytest.raises(ValueError, match="importance"):
        Pruner(importance="random")
    with pytest.raises(ValueError, match="scope"):
        Pruner(scope="local")
    with pytest.raises(ValueError, match="layers"):
        parse_layers("5:2")
    assert parse_layers("2:5") == range(2, 5) and parse_layers(None) is None
    _, pruner = fitted("llama")
    with pytest.raises(ValueError, match="param_ratio"):
        pruner.propose(0.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        pruner.apply(tiny("llama"), {"model.layers.0.self_attn": 24})


def test_align_cli_prune_end_to_end(tmp_path):
    from test_align_cli import run_align

    report = run_align(tmp_path, "--method", "prune", "--scope", "global")
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["gac"]["unit_params"] <= report["budget"] == rows["raw"]["unit_params"]
    assert rows["gac"]["aligned_8"] == 1.0
    model = load(tmp_path / "out")
    widths = {f"model.layers.{i}.mlp": layer.mlp.gate_proj.out_features for i, layer in enumerate(model.model.layers)}
    assert all(report["sizes"]["gac"][n] == w for n, w in widths.items())


def test_predicted_latency_counts_pruned_heads():
    from netgain.align import evaluate

    model, pruner = fitted("llama")
    pruner.apply(model, {"model.layers.0.self_attn": 32})  # 4 of 8 query heads (head_dim 8) kept
    heads = []

    class Recorder:
        def gemm(self, m, k, n):
            return 0.0

        def sdpa(self, batch, h, q_len, kv_len, head_dim):
            heads.append((h, head_dim))
            return 0.0

    evaluate.predicted_latency(model, Recorder(), 8, 8)
    assert heads == [(4, 8), (8, 8)]
