"""Padding-free forwards: packed (with and without shared prompts) and padded layouts give the
same response log-probs, entropies and gradients; the chunked LM head matches a float64
reference; token-budget micro-batches and rank balancing respect their constraints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl import seqlen_balancing
from hybrid_rl.algorithms import entropy_from_logits, sum_pi_squared_from_logits, token_log_probs
from hybrid_rl.engines import hf_model, packing
from hybrid_rl.protocol import Batch
from hybrid_rl.workers.rollout import assemble_rollout

PADDED = hf_model.ForwardOptions(remove_padding=False)
PACKED = hf_model.ForwardOptions(remove_padding=True, share_prompts=False, head_chunk_size=7)
SHARED = hf_model.ForwardOptions(remove_padding=True, share_prompts=True, head_chunk_size=5)


def rollout_batch(vocab: int, pad: int, eos: int, groups: int = 3, n: int = 3, prompt_len: int = 9,
                  resp_len: int = 6, seed: int = 0) -> Batch:
    """Groups of n responses of varied length (one empty) to left-padded prompts of varied length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((groups, prompt_len), pad)
    mask = torch.zeros((groups, prompt_len), dtype=torch.long)
    for i in range(groups):
        length = prompt_len - 2 * i
        ids[i, -length:] = torch.randint(5, vocab, (length,), generator=g)
        mask[i, -length:] = 1
    prompts = Batch(tensors={"input_ids": ids, "attention_mask": mask}).repeat(n, interleave=True)
    responses = []
    for row in range(groups * n):
        length = int(torch.randint(1, resp_len + 3, (1,), generator=g))
        responses.append(torch.randint(5, vocab, (length,), generator=g).tolist())
    responses[1] = [eos]  # a one-token response
    out = assemble_rollout(prompts, responses, [[0.0] * len(r) for r in responses], resp_len, pad, [eos])
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    return rollout_batch(len(tiny_tokenizer), tiny_tokenizer.pad_token_id, tiny_tokenizer.eos_token_id)


def tensors(batch: Batch) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}


def reference_log_probs(model, batch: Batch, temperature: float):
    """Each row on its own, unpadded, with full logits: the plainest possible computation."""
    out_lp = torch.zeros(batch["responses"].shape)
    out_ent = torch.zeros(batch["responses"].shape)
    resp_len = batch["responses"].shape[1]
    for i in range(len(batch)):
        real = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][real][None]
        r = int(batch["response_mask"][i].sum())
        logits = model(input_ids=ids).logits[0, -r - 1:-1].double() / temperature
        out_lp[i, :r] = token_log_probs(logits, batch["responses"][i, :r]).float()
        out_ent[i, :r] = entropy_from_logits(logits).float()
    assert resp_len >= r
    return out_lp, out_ent


@pytest.mark.parametrize("options", [PADDED, PACKED, SHARED], ids=["padded", "packed", "shared_prompts"])
def test_layouts_match_rowwise_reference(model, batch, options):
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        log_probs, entropy = hf_model.response_log_probs(model, tensors(batch), 0.7, options)
        ref_lp, ref_ent = reference_log_probs(model, batch, 0.7)
    assert torch.allclose(log_probs[mask], ref_lp[mask], atol=2e-5)
    assert torch.allclose(entropy[mask], ref_ent[mask], atol=2e-5)
    if options.remove_padding:
        assert (log_probs[~mask] == 0).all()


def test_packed_and_padded_gradients_agree(model, batch):
    mask = batch["response_mask"].float()
    grads = []
    for options in (PADDED, SHARED):
        model.zero_grad()
        log_probs, entropy = hf_model.response_log_probs(model, tensors(batch), 1.0, options)
        ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [PACKED, SHARED], ids=["packed", "shared_prompts"])
def test_cpu_attention_runs_packed_rows_as_one_row_without_padding(model, tiny_model_dir, batch, options):
    """With our CPU attention the model runs the packed tokens as one row (attention alone sees
    the padded rows): the same log-probs as the row-wise reference and the same gradients as
    transformers' SDPA on the padded rows; a model with other attention keeps the padded rows."""
    torch.manual_seed(0)
    flat_model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=hf_model.attn_implementation(torch.device("cpu")))
    inputs, packed = hf_model.packed_inputs(flat_model, tensors(batch), options)
    assert inputs["input_ids"].shape == (1, packed.num_tokens) and "grid_tokens" in inputs
    rows, width = packed.attention_mask.shape[0], packed.attention_mask.shape[-1]
    assert packed.num_tokens < rows * width  # there is padding to skip
    other_inputs, _ = hf_model.packed_inputs(model, tensors(batch), options)
    assert other_inputs["input_ids"].shape == (rows, width) and "grid_tokens" not in other_inputs

    mask = batch["response_mask"]
    grads = []
    for m, layout in ((flat_model, options), (model, PADDED)):
        m.zero_grad()
        log_probs, entropy = hf_model.response_log_probs(m, tensors(batch), 0.7, layout)
        ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        if m is flat_model:
            with torch.no_grad():
                ref_lp, ref_ent = reference_log_probs(model, batch, 0.7)
            assert torch.allclose(log_probs[mask.bool()], ref_lp[mask.bool()], atol=2e-5)
            assert torch.allclose(entropy[mask.bool()], ref_ent[mask.bool()], atol=2e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_shared_prompts_compute_each_prompt_once(batch):
    plain = packing.pack_rows(batch["input_ids"], batch["attention_mask"], 9, share_prompts=False, dense_mask=True)
    shared = packing.pack_rows(batch["input_ids"], batch["attention_mask"], 9, share_prompts=True, dense_mask=True)
    prompt_tokens = batch["attention_mask"][:, :9].sum(-1)
    saved = int(prompt_tokens.sum() - prompt_tokens[::3].sum())  # 3 responses per prompt
    assert plain.num_tokens - shared.num_tokens == saved
    assert int(batch["response_mask"].sum()) == len(shared.keep) == len(plain.keep)
    varlen = packing.pack_rows(batch["input_ids"], batch["attention_mask"], 9, share_prompts=False, dense_mask=False)
    assert varlen.attention_mask is None and varlen.input_ids.shape == (1, plain.num_tokens)
    with pytest.raises(ValueError, match="dense attention mask"):
        packing.pack_rows(batch["input_ids"], batch["attention_mask"], 9, share_prompts=True, dense_mask=False)


def test_dense_packing_spreads_units_over_rows_no_longer_than_the_longest_unit(batch):
    shared = packing.pack_rows(batch["input_ids"], batch["attention_mask"], 9, share_prompts=True, dense_mask=True)
    prompt_lens = batch["attention_mask"][::3, :9].sum(-1)
    response_lens = batch["response_mask"].sum(-1).view(-1, 3).sum(-1)
    units = prompt_lens + response_lens  # one prompt and its 3 responses
    rows, width = shared.input_ids.shape
    assert width == int(units.max()) and 1 < rows < len(units) + 1
    assert shared.attention_mask.shape == (rows, 1, width, width)
    # Every token, padding included, attends at least to itself (no all-masked softmax rows).
    assert shared.attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).all()
    assert shared.num_tokens == int(units.sum()) <= rows * width


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_head_matches_float64_reference(dtype):
    """Several chunks share the head's buffers: each chunk's log-probs and gradients are its own."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 11, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (2, 11))
    g_lp, g_ent = torch.randn(2, 11, dtype=torch.float64), torch.randn(2, 11, dtype=torch.float64)

    log_probs, entropy = packing.head_log_probs(hidden, weight, targets, 0.6, chunk_size=4)
    ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = hidden.double() @ weight.double().T / 0.6
    ref_lp = token_log_probs(logits, targets)
    ref_ent = entropy_from_logits(logits)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    # Log-probs and entropies are accumulated in float32 by design.
    assert torch.allclose(log_probs.double(), ref_lp, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_ent, atol=1e-5)
    assert torch.allclose(got[0], hidden.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(got[1], weight.grad, rtol=1e-4, atol=1e-5)


def test_chunked_head_gives_sum_pi_squared_instead_of_entropy():
    """`sum_pi_squared`: the second output is Σ_v softmax(z)_v² (the optimal token baseline's
    input), chunk by chunk; the log-probs and their gradients are unchanged, and nothing flows
    back through Σπ²."""
    torch.manual_seed(2)
    hidden = torch.randn(13, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    log_probs, sum_sq = packing.head_log_probs(hidden, weight, targets, 0.8, chunk_size=4, sum_pi_squared=True)
    (log_probs.sum() + sum_sq.sum()).backward()
    got = hidden.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden.double() @ weight.double().T / 0.8
    assert torch.allclose(sum_sq.double(), torch.softmax(logits, -1).square().sum(-1), atol=1e-6)
    assert torch.allclose(sum_pi_squared_from_logits(logits), torch.softmax(logits, -1).square().sum(-1))
    token_log_probs(logits, targets).sum().backward()
    assert torch.allclose(log_probs.double(), token_log_probs(logits, targets).detach(), atol=1e-5)
    assert torch.allclose(got.double(), hidden.grad.double(), rtol=1e-4, atol=1e-5)


def test_chunked_head_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,))

    def fn(h, w):
        lp, ent = packing._HeadLogProbs.apply(h, w, targets, 1.3, 2, torch.float64, True, False)
        return lp.double(), ent.double()

    # The forward accumulates in float32, so compare at float32 precision.
    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_head_gradient_written_into_grad_equals_the_autograd_one(compute_dtype):
    """`into_grad` adds the weight's gradient to `weight.grad` (on top of what is there) instead of
    returning it; in bf16 the float32 sum goes through the buffers block by block (here 2 blocks)."""
    torch.manual_seed(3)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    targets = torch.randint(0, 40, (10,))
    earlier = torch.randn(40, 8)
    grads = {}
    for into_grad in (False, True):
        weight.grad = earlier.clone()
        log_probs, entropy = packing.head_log_probs(hidden, weight, targets, 0.7, chunk_size=4,
                                                    compute_dtype=compute_dtype, into_grad=into_grad)
        (log_probs.sum() + entropy.sum()).backward()
        grads[into_grad] = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = None
    assert torch.equal(grads[True][0], grads[False][0])
    # The same sums, in another order: chunk by chunk onto the earlier gradient.
    torch.testing.assert_close(grads[True][1], grads[False][1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(grads[True][1], earlier)
    # Without a gradient yet, the head creates it; no position at all still gives a dense zero one.
    weight.grad = None
    log_probs, _ = packing.head_log_probs(hidden[:0], weight, targets[:0], 1.0, chunk_size=4, into_grad=True)
    log_probs.sum().backward()
    assert weight.grad is not None and not weight.grad.is_sparse and not weight.grad.any()
    # What autograd itself hands back for the weight is nothing: the gradient went to .grad.
    log_probs, _ = packing.head_log_probs(hidden, weight, targets, 1.0, chunk_size=4, into_grad=True)
    assert torch.autograd.grad(log_probs.sum(), weight, allow_unused=True) == (None,)
    assert weight.grad.any()


@pytest.mark.parametrize("kept_chunks", [0, 1, 3])
def test_head_backward_reads_kept_log_softmax_or_computes_it_again(monkeypatch, kept_chunks):
    """On CPU the forward keeps up to a budget of chunks' log-softmax for backward; backward
    computes the others again, and all of them again when another forward has taken the buffers
    since its own. Gradients are the float64 reference's either way."""
    vocab, chunk = 50, 4  # 10 positions: chunks of 4, 4 and 2
    monkeypatch.setattr(packing, "KEPT_LOG_SOFTMAX_BYTES", kept_chunks * chunk * vocab * 4)
    packing._cached_chunk_buffers.cache_clear()
    computed = []
    log_softmax = packing._ChunkBuffers.log_softmax
    monkeypatch.setattr(packing._ChunkBuffers, "log_softmax",
                        lambda self, *args, **kwargs: computed.append(1) or log_softmax(self, *args, **kwargs))
    torch.manual_seed(4)
    weight = torch.randn(vocab, 8, dtype=torch.float64, requires_grad=True)
    hiddens = [torch.randn(10, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    targets = torch.randint(0, vocab, (10,))
    outputs = [packing.head_log_probs(h, weight, targets, 0.9, chunk_size=chunk) for h in hiddens]
    assert len(computed) == 6
    for i in (1, 0):  # the second forward's backward first: the first one's kept chunks are gone
        (outputs[i][0].sum() + outputs[i][1].sum()).backward()
        reference = hiddens[i].detach().clone().requires_grad_()
        logits = reference @ weight.detach().T / 0.9
        (token_log_probs(logits, targets).sum() + entropy_from_logits(logits).sum()).backward()
        torch.testing.assert_close(hiddens[i].grad, reference.grad, rtol=1e-5, atol=1e-6)
    assert len(computed) == 6 + (3 - min(kept_chunks, 3)) + 3
    # A second backward through the same graph finds the kept chunks used up, and computes them.
    log_probs, entropy = packing.head_log_probs(hiddens[0], weight, targets, 0.9, chunk_size=chunk)
    first, = torch.autograd.grad(log_probs.sum() + entropy.sum(), hiddens[0], retain_graph=True)
    second, = torch.autograd.grad(log_probs.sum() + entropy.sum(), hiddens[0])
    torch.testing.assert_close(first, second, rtol=1e-6, atol=1e-9)
    packing._cached_chunk_buffers.cache_clear()


def test_log_prob_only_head_gives_the_same_log_probs_and_gradients():
    torch.manual_seed(2)
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (9,))
    results = []
    for with_entropy in (True, False):
        log_probs, entropy = packing.head_log_probs(hidden, weight, targets, 0.8, chunk_size=4,
                                                    with_entropy=with_entropy)
        log_probs.sum().backward()
        results.append((log_probs.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    full, only = results
    assert torch.equal(full[0], only[0]) and torch.equal(full[2], only[2]) and torch.equal(full[3], only[3])
    assert (full[1] > 0).all() and (only[1] == 0).all()


def test_token_budget_micro_batches(batch):
    for share in (False, True):
        units, costs = seqlen_balancing.cost_units(batch, share)
        count = seqlen_balancing.token_budget_bins(batch, 40, share)
        parts = seqlen_balancing.split_into(batch, count, share)
        rows = torch.cat(parts)
        assert sorted(rows.tolist()) == list(range(len(batch)))
        assert all(len(p) > 0 for p in parts)
        loads = [sum(c for u, c in zip(units, costs) if set(u) <= set(p.tolist())) for p in parts]
        assert sum(loads) <= sum(costs)
    # A budget above the whole batch gives one micro-batch; one token per bin gives one row each.
    assert seqlen_balancing.token_budget_bins(batch, 10_000, True) == 1
    assert seqlen_balancing.token_budget_bins(batch, 1, False) == len(batch)


def test_balanced_partition_is_balanced_and_equal_sized():
    costs = [9, 8, 7, 6, 5, 4, 3, 2]
    bins = seqlen_balancing.balanced_partition(costs, 2, equal_size=True)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert [len(b) for b in bins] == [4, 4]
    totals = [sum(costs[i] for i in b) for b in bins]
    assert abs(totals[0] - totals[1]) <= 2
    with pytest.raises(ValueError, match="equal bins"):
        seqlen_balancing.balanced_partition(costs[:7], 2, equal_size=True)


def test_balance_permutation_keeps_groups_whole(batch):
    order = seqlen_balancing.balance_permutation(batch, 3, share_prompts=True)
    assert sorted(order.tolist()) == list(range(len(batch)))
    # 3 groups of 3 over 3 ranks: each rank's chunk is one whole group.
    for chunk in order.view(3, 3):
        assert len({int(c) // 3 for c in chunk}) == 1


def test_frozen_cpu_engine_holds_its_linears_in_bf16_with_the_same_log_probs(tiny_model_dir, monkeypatch):
    """A frozen engine (reference, reward model) under CPU bf16 autocast keeps its linear layers
    in bf16, since autocast would cast them in every forward: the same log-probs, bit for bit.
    Embeddings (tied to the head here) and norms stay float32."""
    from hybrid_rl.engines import ModelSpec, Output, build_engine
    from tests.engine_helpers import actor_config, rollout_batch

    cfg = actor_config("fsdp", dtype="bf16")
    spec = ModelSpec("ref", tiny_model_dir, cfg.actor_rollout_ref.model)  # no optimizer: frozen
    cpu = torch.device("cpu")
    frozen = build_engine(spec, cfg.actor_rollout_ref.actor, cpu)
    monkeypatch.setattr(hf_model, "cast_frozen_linears", lambda *args, **kwargs: 0)
    in_float32 = build_engine(spec, cfg.actor_rollout_ref.actor, cpu)
    dtypes = {name: p.dtype for name, p in frozen.module.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    assert all(p.dtype == torch.float32 for p in in_float32.module.parameters())
    batch = rollout_batch(0)
    ours, reference = (engine.infer(batch, Output.LOG_PROBS, 0.7, 3, None)["log_probs"]
                       for engine in (frozen, in_float32))
    assert torch.equal(ours, reference) and ours.abs().sum() > 0


# verl's examples/prefix_grouper script sets both (its prefix grouper patches padded rows' attention).
PREFIX_GROUPER = ("actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.model.use_remove_padding=false")


def test_verls_prefix_grouper_computes_each_prompt_once_with_the_same_log_probs(tiny_model_dir):
    """verl's use_prefix_grouper, given as its example gives it, runs the prompt-sharing
    padding-free rows: one copy of each group's prompt is computed (fewer tokens), and log-probs,
    entropies and the step equal those of padded rows."""
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.engines import Output
    from tests.engine_helpers import actor_config, make_engine, rollout_batch, step

    grouped_cfg = actor_config("fsdp2", extra=PREFIX_GROUPER)
    assert grouped_cfg.actor_rollout_ref.model.use_remove_padding and grouped_cfg.actor_rollout_ref.model.share_prompt_prefix
    padded_cfg = actor_config("fsdp2", extra=PREFIX_GROUPER[1:])
    grouped, padded = make_engine(grouped_cfg, tiny_model_dir), make_engine(padded_cfg, tiny_model_dir)
    assert grouped.share_prompts and not padded.share_prompts
    batch = rollout_batch(3, rows=4).repeat(2)  # two responses to each prompt
    outputs = [engine.infer(batch, Output.LOG_PROBS_ENTROPY, 0.7, 4, None) for engine in (grouped, padded)]
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert (outputs[0][key] - outputs[1][key])[mask].abs().max() <= 1e-5
    rows = [seqlen_balancing.cost_units(batch, share)[1] for share in (True, False)]
    prompt_tokens = sum(seqlen_balancing.row_lengths(batch)[1][::2])
    assert sum(rows[1]) - sum(rows[0]) == prompt_tokens  # one copy of each prompt fewer
    first = [step(engine, cfg, 1) for engine, cfg in ((grouped, grouped_cfg), (padded, padded_cfg))]
    assert first[0]["actor/loss"] == pytest.approx(first[1]["actor/loss"], rel=1e-5)
    assert first[0]["actor/grad_norm"] == pytest.approx(first[1]["actor/grad_norm"], rel=1e-4)

    with pytest.raises(ConfigError, match="use_prefix_grouper=true shares each prompt .* strategy=fsdp2"):
        validate_config(actor_config("megatron", extra=PREFIX_GROUPER))
    unshared = actor_config("fsdp2", extra=PREFIX_GROUPER[1:])
    unshared.actor_rollout_ref.actor.use_prefix_grouper = True  # set after the config was resolved
    with pytest.raises(ValueError, match="use_prefix_grouper=true .* needs model.use_remove_padding=true"):
        make_engine(unshared, tiny_model_dir)
