"""Continuous-batching engine (`jmarl.models.generation.engine`): greedy equal to the static sampler,
sampled log-probs equal to re-scoring, reproducible across slot counts, refills, shared
prompts prefilled once, the KV budget, the ModelSampler integration and its stats, and the engine on
a mesh of 8 simulated devices (slots split over data x fsdp, equal to one device; its planned programs)."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from _tiny_models import tiny_qwen3
from jmarl import models
from jmarl.errors import JmarlError
from jmarl.padding import bucket_length
from jmarl.models.generation import budget, engine, engine_programs, static
from jmarl.models.generation.layout import make_layout
from jmarl.models.generation.spec import GenerationSpec
from jmarl.train.policies import PolicyGroup, PolicySet, stack
from jmarl.config import SamplingConfig
from jmarl.train.sampling import ModelSampler, left_pad

TINY = tiny_qwen3(vocab_size=99)  # the CharTokenizer's vocabulary
PARAMS = jax.jit(models.init, static_argnums=0)(TINY, jax.random.key(0))
N_NEW = 10


def _prompts(count, seed=0, low=2, high=9):
    rs = np.random.default_rng(seed)
    return [rs.integers(3, TINY.vocab_size, int(rs.integers(low, high))).tolist() for _ in range(count)]


def _static(prompt, **kwargs):
    tokens, mask = left_pad([prompt], 1, 8, 0)
    g = jax.device_get(models.generate(TINY, PARAMS, tokens, mask, jax.random.key(0), GenerationSpec(**kwargs)))
    n = int(g.lengths[0])
    return g.tokens[0, :n], g.logprobs[0, :n]


def _stop_token():
    """A token the greedy static sampler emits mid-way for the first prompt (so stops happen)."""
    tokens, _ = _static(_prompts(1)[0], max_new_tokens=N_NEW, temperature=0.0)
    return int(tokens[3])


def _count_shrinks(monkeypatch) -> list[int]:
    """From now on, every call of the engine's tail shrink appends its new slot count to the list."""
    shrinks: list[int] = []
    real = engine_programs.shrink_program

    def build(slots, *static):
        fn = real(slots, *static)

        def call(*args):
            shrinks.append(slots)
            return fn(*args)

        return call

    monkeypatch.setattr(engine_programs, "shrink_program", build)
    return shrinks


@pytest.mark.slow
def test_greedy_equals_static_sampler_with_refills_and_stops():
    prompts = _prompts(6)
    stop = _stop_token()
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, stop_tokens=(stop,), num_slots=4, chunk_steps=4)
    res = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(1), spec)
    assert res.stats.prefills > 1 and res.stats.rows == 6
    lengths = []
    for r, prompt in enumerate(prompts):
        want_tokens, want_lp = _static(prompt, max_new_tokens=N_NEW, temperature=0.0, stop_tokens=(stop,))
        got_tokens, got_lp = res.completions[r][0]
        np.testing.assert_array_equal(got_tokens, want_tokens)
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
        lengths.append(len(got_tokens))
    assert min(lengths) < N_NEW  # the stop token ended at least one row early
    assert min(lengths) > 3  # long enough that equal tokens say something about the decode steps


def _rescored(prompt, completion, temperature):
    """token_logprobs of the completion after its prompt (left-padded to one width: one compile)."""
    full, mask = left_pad([prompt + completion.tolist()], 1, 8 + N_NEW, 0)
    lp = models.token_logprobs(TINY, PARAMS, full, mask, temperature)
    return np.asarray(lp)[0, 8 + N_NEW - len(completion):]


@pytest.mark.slow
def test_sampled_logprobs_equal_rescoring_under_truncation():
    prompts = _prompts(3, seed=1)
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.7, top_k=5, top_p=0.9, num_slots=4, chunk_steps=4)
    res = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(2), spec)
    for r, prompt in enumerate(prompts):
        for tokens, logprobs in res.completions[r]:
            assert len(tokens) == N_NEW
            np.testing.assert_allclose(logprobs, _rescored(prompt, tokens, 0.7), atol=1e-4)


@pytest.mark.slow
def test_same_seed_same_outputs_whatever_the_slots(monkeypatch):
    """Also with the tail shrink off: the first run's last rows move to fewer slots (the shrink
    runs), and the tokens are those of the runs that keep every slot."""
    prompts = _prompts(5, seed=2)
    limits = [3, N_NEW, 1, 7, 5]  # rows end at different steps: refills happen at different points
    shrinks = _count_shrinks(monkeypatch)

    def sample(slots, chunk, shrink=True):
        spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, num_slots=slots, chunk_steps=chunk,
                              shrink=shrink)
        return engine.run(TINY, PARAMS, prompts, 3, jax.random.key(7), spec, limits=limits)

    runs = [sample(4, 2)]
    assert shrinks and all(s < 4 for s in shrinks)  # the tail moved to fewer than the 4 slots
    runs += [sample(4, 2, shrink=False), sample(4, 4), sample(1, 4)]
    for other in runs[1:]:
        for a, b in zip(runs[0].completions, other.completions):
            for (ta, la), (tb, lb) in zip(a, b):
                np.testing.assert_array_equal(ta, tb)
                np.testing.assert_allclose(la, lb, atol=1e-5)
    # the completions of one request differ (their draws are their own)
    assert any(not np.array_equal(runs[0].completions[0][0][0], c[0]) for c in runs[0].completions[0][1:])
    different = engine.run(TINY, PARAMS, prompts, 3, jax.random.key(8),
                           GenerationSpec(max_new_tokens=N_NEW, num_slots=4, chunk_steps=4), limits=limits)
    assert any(not np.array_equal(a[0][0], b[0][0]) for a, b in zip(runs[0].completions, different.completions))


@pytest.mark.slow
def test_more_requests_than_slots_all_served_with_per_request_limits():
    prompts = _prompts(9, seed=3)
    limits = [1 + (3 * r) % N_NEW for r in range(9)]
    res = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(3),
                     GenerationSpec(max_new_tokens=N_NEW, num_slots=4, chunk_steps=4), limits=limits)
    st = res.stats
    assert st.rows == 18 and st.slots == 4 and st.prefills >= 3
    for r in range(9):
        assert [len(t) for t, _ in res.completions[r]] == [limits[r]] * 2
    assert 0 < st.busy_slot_steps <= st.slot_steps
    assert st.queue_wait_chunks > 0  # later requests waited for slots


def test_with_the_queue_empty_one_drain_runs_until_the_state_can_shrink(monkeypatch):
    """All 8 requests fit the 8 slots, so nothing is queued: without shrinking, one decode call
    (a drain) serves the whole run whatever chunk_steps says; with shrinking, the drain stops
    once at most a quarter of the slots are busy, the state shrinks, and a second drain ends
    the run. The completions are the same either way (draws depend on the seed only)."""
    prompts = _prompts(8, seed=4)
    limits = [1, 2, 2, 3, 3, 4, N_NEW, N_NEW]  # two long rows: the tail
    spec = GenerationSpec(max_new_tokens=N_NEW, num_slots=8, chunk_steps=2)
    whole = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(5), dataclasses.replace(spec, shrink=False),
                       limits=limits)
    assert whole.stats.chunks == 1
    shrinks = _count_shrinks(monkeypatch)
    tail = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(5), spec, limits=limits)
    assert tail.stats.chunks == 2 and shrinks == [2]
    assert tail.stats.slot_steps < whole.stats.slot_steps
    for a, b in zip(whole.completions, tail.completions):
        np.testing.assert_array_equal(a[0][0], b[0][0])
        np.testing.assert_allclose(a[0][1], b[0][1], atol=1e-6)


def _count_programs(monkeypatch) -> list[str]:
    """From now on, every call of an engine program appends its name to the list."""
    names: list[str] = []
    for name in ("prepare_program", "init_program", "prefill_program", "start_program", "chunk_program",
                 "fused_program", "shrink_program"):
        real = getattr(engine_programs, name)

        def build(*static, real=real, name=name):
            fn = real(*static)

            def call(*args):
                names.append(name.strip("_").removesuffix("_program"))
                return fn(*args)

            return call

        monkeypatch.setattr(engine_programs, name, build)
    return names


@pytest.mark.slow
def test_a_run_that_fits_the_slots_is_one_program(monkeypatch):
    """Every completion fits the slots at once: state, prefill, start and drain run as one program
    (no parameter cast of its own either), with the tokens of the general path's programs (here
    taken because one prefill call may hold fewer prompts than the run has). Whatever the path, a
    request's completions sit in consecutive slots and read their prompt in a group."""
    prompts = _prompts(4, seed=12)
    limits = [N_NEW, 3, N_NEW, 6]
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, num_slots=8, chunk_steps=2, shrink=False)
    names = _count_programs(monkeypatch)
    fused = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(9), spec, limits=limits)
    assert names == ["fused"]
    st = fused.stats
    assert (st.fused, st.prefills, st.chunks, st.grouped_chunks, st.rows) == (1, 1, 1, 1, 8)
    names.clear()
    general = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(9), dataclasses.replace(spec, max_prefill=2),
                         limits=limits)
    assert names == ["init", "prepare", "prefill", "prefill", "chunk"]
    assert (general.stats.fused, general.stats.prefills, general.stats.grouped_chunks) == (0, 2, 1)
    for a, b in zip(fused.completions, general.completions):  # one program or several: XLA may round apart
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-6)
    assert [[len(t) for t, _ in c] for c in fused.completions] == [[limit] * 2 for limit in limits]
    # its tail shrinks as the general path's does: the fused program stops at the shrink point, and
    # the smaller state decodes on with the general path's programs
    names.clear()
    tail = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(9), dataclasses.replace(spec, shrink=True),
                      limits=[1, 2, N_NEW, 2])
    assert names[0] == "fused" and "shrink" in names and "init" not in names and "prefill" not in names
    whole = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(9), spec, limits=[1, 2, N_NEW, 2])
    for a, b in zip(tail.completions, whole.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-6)


@pytest.mark.slow
def test_grouped_prompts_equal_a_gather_per_slot(monkeypatch):
    """Slots read their request's prompt in groups (the static sampler's group attention) while a
    request's completions lie in consecutive slots; refills that break that order fall back to a
    gather per slot. The tokens are those of a gather per slot throughout, and greedy ones the
    static sampler's."""
    prompts = _prompts(6, seed=13)
    # many stop tokens: a request's two completions end at different steps
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, num_slots=4, chunk_steps=2,
                          stop_tokens=tuple(range(3, 30)))
    runs = {}
    for name, layout in (("grouped", engine.group_size), ("gathered", lambda config, counts: 0)):
        monkeypatch.setattr(engine, "group_size", layout)
        runs[name] = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(0), spec)
        runs[name + " greedy"] = engine.run(TINY, PARAMS, prompts[:3], 2, jax.random.key(0),
                                            dataclasses.replace(spec, temperature=0.0, num_slots=8, stop_tokens=()))
    st = runs["grouped"].stats
    assert st.fused == 0 and 0 < st.grouped_chunks < st.chunks  # queued: refills mix the slots
    assert runs["grouped greedy"].stats.grouped_chunks == runs["grouped greedy"].stats.fused == 1
    assert runs["gathered"].stats.grouped_chunks == runs["gathered greedy"].stats.grouped_chunks == 0
    for name in ("", " greedy"):
        for a, b in zip(runs["grouped" + name].completions, runs["gathered" + name].completions):
            for (ta, la), (tb, lb) in zip(a, b):
                np.testing.assert_array_equal(ta, tb)
                np.testing.assert_allclose(la, lb, atol=1e-5)
    for r, prompt in enumerate(prompts[:3]):
        want_tokens, want_lp = _static(prompt, max_new_tokens=N_NEW, temperature=0.0)
        for tokens, logprobs in runs["grouped greedy"].completions[r]:
            np.testing.assert_array_equal(tokens, want_tokens)
            np.testing.assert_allclose(logprobs, want_lp, atol=1e-5)
    monkeypatch.undo()
    assert engine.group_size(TINY, [2, 2, 3]) == 0  # requests of unequal counts: a gather per slot
    assert engine.group_size(TINY, [3, 3]) == 3


def test_start_returns_at_the_first_dispatch():
    """`start` returns once the first program is dispatched; `jax.block_until_ready` on the run does
    the rest of its device work, `result()` gives what `run` gives. Argument errors come at `start`."""
    prompts = _prompts(5, seed=14)
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, num_slots=4, chunk_steps=2)
    pending = engine.start(TINY, PARAMS, prompts, 2, jax.random.key(3), spec)
    assert isinstance(pending, engine.EngineRun)
    assert jax.block_until_ready(pending) is pending
    got, want = pending.result(), engine.run(TINY, PARAMS, prompts, 2, jax.random.key(3), spec)
    assert got.stats == want.stats
    for a, b in zip(got.completions, want.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(la, lb)
    assert engine.start(TINY, PARAMS, [], 2, jax.random.key(3), spec).result().completions == []
    with pytest.raises(JmarlError, match="limit"):
        engine.start(TINY, PARAMS, prompts, 2, jax.random.key(3), spec, limits=[0] * 5)


def test_fused_program_holds_no_more_than_the_planned_prefill():
    """The memory planner plans the prefill and decode programs (`planned_programs`); a fused run
    holds its state, the policy's cast weights and its temporaries, no more than the largest
    planned prefill holds with its arguments (a stacked policy selected in the program)."""
    import jax.numpy as jnp

    stacked = stack([PARAMS, PARAMS])
    s, q, p = 64, 16, 64
    spec = GenerationSpec(max_new_tokens=32)
    planned = dict((name, (fn, args)) for name, fn, args in
                   engine.planned_programs(TINY, stacked, spec, slots=s, entries=q, prompt_len=p, select=True))
    fn, args = planned["engine_prefill"]
    prefill = fn.lower(*args).compile().memory_analysis()
    u = args[2].shape[0]  # the planned prefill's prompts: the most one call holds
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    fused_args = (stacked, np.int32(1), i32(u, p), jax.ShapeDtypeStruct((u, p), bool), i32(u)) + (i32(s),) * 5 + (
        jax.random.key(0), np.float32(1), np.float32(1), np.int32(0))
    fused = engine_programs.fused_program(TINY, s, q, p, 32, 32, *spec.program_sampling(), 0, None, 0, True).lower(
        *fused_args).compile().memory_analysis()
    assert fused.temp_size_in_bytes + fused.output_size_in_bytes <= (
        prefill.argument_size_in_bytes + prefill.temp_size_in_bytes)


def test_shared_prompt_prefilled_once():
    prompt = _prompts(1, seed=4)
    res = engine.run(TINY, PARAMS, prompt, 4, jax.random.key(4),
                     GenerationSpec(max_new_tokens=N_NEW, num_slots=4, chunk_steps=4))
    assert res.stats.prefills == 1 and res.stats.prompts_prefilled == 1
    assert len(res.completions[0]) == 4


def test_budget_caps_slots_and_entries_and_refuses_a_request_that_cannot_fit():
    p = bucket_length(8)
    per_slot, per_entry = budget.slot_bytes(TINY, N_NEW), budget.entry_bytes(TINY, p)
    assert per_slot == 2 * 2 * 2 * 8 * (N_NEW - 1) * 4  # a slot holds its generated tokens only
    assert per_entry == 2 * 2 * 2 * 8 * p * 4 + 4 * TINY.vocab_size  # a prompt's cache and its logits
    # requests of 4 completions: Q = ceil(2 S / 4) entries for S slots
    assert [budget.entries_for(s, 4) for s in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [budget.entries_for(s, 1) for s in (1, 8)] == [1, 8]  # unshared prompts: one entry per slot
    fits4 = 4 * per_slot + 2 * per_entry
    assert budget.slots_for_budget(TINY, p, N_NEW, fits4, rows=100, share=4) == (4, 2)
    assert budget.slots_for_budget(TINY, p, N_NEW, fits4 - 1, rows=100, share=4) == (2, 1)
    assert budget.slots_for_budget(TINY, p, N_NEW, 64 * fits4, rows=3, share=4) == (4, 2)  # no more than the rows
    # the same budget holds more slots when prompts are shared than when they are not
    assert budget.slots_for_budget(TINY, p, N_NEW, fits4, rows=100, share=1)[0] < 4
    res = engine.run(TINY, PARAMS, _prompts(3), 4, jax.random.key(0),
                     GenerationSpec(max_new_tokens=N_NEW, kv_budget_bytes=fits4, chunk_steps=4))
    assert (res.stats.slots, res.stats.entries, res.stats.rows) == (4, 2, 12)
    assert res.stats.prompts_prefilled == 3  # one entry per request
    with pytest.raises(JmarlError, match="sampling.kv_budget_bytes"):
        engine.run(TINY, PARAMS, _prompts(3), 2, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, kv_budget_bytes=per_slot + per_entry - 1))
    assert budget.default_kv_budget() > 0


def test_a_refill_prefills_at_most_max_prefill_prompts_per_call():
    """More new prompts than one prefill call may hold: several calls, the same tokens; the
    default cap keeps a call's prompts' keys/values within a quarter of the budget."""
    prompts = _prompts(7, seed=11)
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, chunk_steps=4, num_slots=8)
    whole = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(6), spec)
    split = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(6), dataclasses.replace(spec, max_prefill=2))
    assert whole.stats.prefills == 1 and split.stats.prefills == 4  # 7 prompts: 2 + 2 + 2 + 1
    assert split.stats.prompts_prefilled == whole.stats.prompts_prefilled == 7
    for a, b in zip(whole.completions, split.completions):
        np.testing.assert_array_equal(a[0][0], b[0][0])
        np.testing.assert_allclose(a[0][1], b[0][1], atol=1e-5)
    p = bucket_length(8)
    prompt_kv = budget.kv_bytes(TINY, p)
    assert budget.prefill_prompts(TINY, p, 4 * 3 * prompt_kv) == 2  # 3 fit a quarter: a power of two, 2
    assert budget.prefill_prompts(TINY, p, prompt_kv) == 1  # at least one


@pytest.mark.slow
def test_completions_share_their_prompt_entry_and_wait_for_a_free_one():
    """A request's completions read one pool entry; with fewer entries than requests in flight
    the queue waits for one to be given back, and the tokens are those of a roomy pool."""
    prompts = _prompts(6, seed=9)
    limits = [2, N_NEW, 3, 1, N_NEW, 5]
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, chunk_steps=2, num_slots=4)
    roomy = engine.run(TINY, PARAMS, prompts, 3, jax.random.key(5), dataclasses.replace(spec, num_entries=4),
                       limits=limits)
    tight = engine.run(TINY, PARAMS, prompts, 3, jax.random.key(5), dataclasses.replace(spec, num_entries=1),
                       limits=limits)
    assert (roomy.stats.entries, tight.stats.entries) == (4, 1)
    assert tight.stats.entry_waits > 0 and tight.stats.prompts_prefilled == 6  # each prompt prefilled once
    for a, b in zip(roomy.completions, tight.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_allclose(la, lb, atol=1e-5)
    # the entry's cache is the prompt's: sampled log-probs equal re-scoring after the prompt
    for r, prompt in enumerate(prompts):
        for tokens, logprobs in tight.completions[r]:
            assert len(tokens) == limits[r]
            np.testing.assert_allclose(logprobs, _rescored(prompt, tokens, 1.0), atol=1e-4)


def _policy_set():
    tok = models.CharTokenizer()
    stacked = stack([PARAMS, models.init(TINY, jax.random.key(1))])
    group = PolicyGroup(name="g", model_config=TINY, tokenizer=tok, policy_ids=(0, 1), stacked=True, lora_rank=None,
                        lora_alpha=1.0, base=None, state=types.SimpleNamespace(params=stacked), ref=None)
    return PolicySet(policy_names=("a", "b"), agent_policy=(0, 1), groups=[group])


@pytest.mark.slow
def test_model_sampler_continuous_equals_static_greedy_and_decodes_no_padding_rows():
    policies = _policy_set()
    requests = [(0, "hi"), (1, "hello there"), (1, "abc")]
    static = ModelSampler(policies, SamplingConfig(max_new_tokens=6, temperature=0.0))
    cont = ModelSampler(policies, SamplingConfig(max_new_tokens=6, temperature=0.0, engine="continuous",
                                                 kv_budget_bytes=1 << 20, engine_chunk_steps=4))
    a = static.sample(requests, 2, jax.random.key(0))
    b = cont.sample(requests, 2, jax.random.key(0))
    for ca, cb in zip(a, b):
        assert len(ca) == len(cb) == 2
        for x, y in zip(ca, cb):
            assert len(x.completion_tokens) > 3  # no early stop: equal tokens over several decode steps
            np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    stats = cont.take_stats()
    assert stats["rollout/row_utilization"] == 1.0
    assert 0 < stats["rollout/slot_utilization"] <= 1.0
    assert stats["rollout/queue_wait"] == 0.0 and stats["time/generate"] > 0
    assert stats["rollout/entry_waits"] == 0.0  # every request found a pool entry
    assert static.take_stats()["rollout/row_utilization"] == 6 / 8  # [2 policies, 4 rows], 6 real
    # one policy asked: only its rows
    cont.sample([(1, "x")], 2, jax.random.key(0))
    assert cont.take_stats()["rollout/row_utilization"] == 1.0
    assert cont.take_stats() == {"time/generate": 0.0}  # reset by the previous call


@pytest.mark.slow
def test_model_sampler_continuous_pipelines_calls_of_several_groups():
    """Two policy groups: two engine calls, the second started (`engine.start`) before the first
    one's completions are built. Every request gets its own group's greedy completions, as static."""
    tok = models.CharTokenizer()
    groups = [PolicyGroup(name=name, model_config=TINY, tokenizer=tok, policy_ids=(i,), stacked=False, lora_rank=None,
                          lora_alpha=1.0, base=None, state=types.SimpleNamespace(params=params), ref=None)
              for i, (name, params) in enumerate((("a", PARAMS), ("b", models.init(TINY, jax.random.key(1)))))]
    policies = PolicySet(policy_names=("a", "b"), agent_policy=(0, 1), groups=groups)
    requests = [(1, "hello"), (0, "hi"), (1, "abc"), (0, "xyz")]
    settings = dict(max_new_tokens=5, temperature=0.0)
    static = ModelSampler(policies, SamplingConfig(**settings)).sample(requests, 2, jax.random.key(0))
    cont = ModelSampler(policies, SamplingConfig(**settings, engine="continuous", kv_budget_bytes=1 << 20))
    got = cont.sample(requests, 2, jax.random.key(0))
    assert cont.engine_stats.rows == 8
    for ca, cb in zip(static, got):
        assert [len(c.completion_tokens) for c in cb] == [len(c.completion_tokens) for c in ca]
        for x, y in zip(ca, cb):
            np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
            assert y.text == tok.decode(y.completion_tokens.tolist())
    # the groups' parameters differ, so a request answered by the other group would differ
    assert [c.completion_tokens.tolist() for c in got[0]] != [c.completion_tokens.tolist() for c in
                                                             cont.sample([(0, "hello")], 2, jax.random.key(0))[0]]


@pytest.mark.slow
def test_static_calls_pad_rows_to_a_quarter_at_most():
    """A static call of 5 requests x 2 rows decodes 10 rows (a power of two would decode 16)."""
    policies = _policy_set()
    sampler = ModelSampler(policies, SamplingConfig(max_new_tokens=4, temperature=0.0))
    got = sampler.sample([(1, t) for t in ("a", "bb", "ccc", "dd", "e")], 2, jax.random.key(0))
    assert [len(c) for c in got] == [2] * 5
    assert sampler.take_stats()["rollout/row_utilization"] == 1.0
    sampler.sample([(1, t) for t in ("a", "bb", "ccc", "dd", "e", "f")], 3, jax.random.key(0))  # 18 rows -> 20
    assert sampler.take_stats()["rollout/row_utilization"] == 18 / 20


@pytest.mark.slow
def test_max_rows_per_call_caps_the_engine_slots_without_splitting_the_queue():
    policies = _policy_set()
    requests = [(1, "hi"), (1, "hello there"), (1, "abc"), (1, "x")]
    settings = dict(max_new_tokens=6, temperature=1.0, engine="continuous", kv_budget_bytes=1 << 20,
                    engine_chunk_steps=4)
    free = ModelSampler(policies, SamplingConfig(**settings))
    capped = ModelSampler(policies, SamplingConfig(**settings, max_rows_per_call=3))
    a = free.sample(requests, 2, jax.random.key(3))
    b = capped.sample(requests, 2, jax.random.key(3))
    assert free.engine_stats.slots == 8 and capped.engine_stats.slots == 2  # 3 rounds down to a power of two
    assert capped.engine_stats.requests == 4  # one engine run of all four requests (not split into calls)
    for ca, cb in zip(a, b):  # sampling keys follow (request, completion): the same tokens with fewer slots
        for x, y in zip(ca, cb):
            np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
    assert budget.planned_slots(TINY, 64, 8, 2, GenerationSpec(max_new_tokens=6, kv_budget_bytes=1 << 20,
                                                               max_slots=3)) == (2, 2)


@pytest.mark.slow
def test_static_calls_are_pipelined_one_kv_cache_at_a_time(monkeypatch):
    from jmarl.train import sampling as sampling_mod

    policies = _policy_set()
    requests = [(1, "hi"), (1, "hello there"), (1, "abc"), (1, "x"), (1, "yz")]
    events = []
    real_generate = sampling_mod.static.generate

    def generate(*args, **kwargs):
        events.append(("dispatch", len([e for e in events if e[0] == "dispatch"])))
        return real_generate(*args, **kwargs)

    real_wait, real_finish = sampling_mod._Call.wait, sampling_mod._Call.finish
    monkeypatch.setattr(sampling_mod.static, "generate", generate)
    monkeypatch.setattr(sampling_mod._Call, "wait", lambda self: (events.append(("wait",)), real_wait(self))[1])
    monkeypatch.setattr(sampling_mod._Call, "finish", lambda self: (events.append(("finish",)), real_finish(self))[1])
    chunked = ModelSampler(policies, SamplingConfig(max_new_tokens=6, temperature=0.0, max_rows_per_call=4))
    got = chunked.sample(requests, 2, jax.random.key(0))  # 2 requests x 2 rows per call: 3 calls
    # call k+1 is dispatched after call k finished on the device, and call k's completions are
    # built while call k+1 decodes
    assert events == [("dispatch", 0), ("wait",), ("dispatch", 1), ("finish",), ("wait",), ("dispatch", 2),
                      ("finish",), ("finish",)]
    monkeypatch.setattr(sampling_mod.static, "generate", real_generate)
    whole = ModelSampler(policies, SamplingConfig(max_new_tokens=6, temperature=0.0)).sample(requests, 2, jax.random.key(0))
    for ca, cb in zip(got, whole):  # greedy: the same tokens whatever the calls
        assert [c.text for c in ca] == [c.text for c in cb]
        for x, y in zip(ca, cb):
            assert len(x.completion_tokens) > 3
            np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)


def test_sampling_config_fields():
    cfg = SamplingConfig(engine="continuous", kv_budget_bytes="2MiB")
    assert cfg.engine == "continuous" and cfg.kv_budget() == 2 << 20
    assert SamplingConfig().engine == "static" and SamplingConfig().kv_budget() is None


# ---------------------------------------------------------------------------------- on a mesh
def _assert_loop_bodies_move_nothing(text):
    """The compiled program (HLO text) has while loops, whose bodies hold no collective: each
    device decodes its own slots from its own part of the pool, with weights gathered before."""
    import re

    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", text))
    assert bodies
    seen = 0
    for comp in re.split(r"\n(?=\S)", text):
        words = comp.split(" ", 2)
        name = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
        if name in bodies:
            seen += 1
            assert "all-gather" not in comp and "all-to-all" not in comp and "collective-permute" not in comp
    assert seen == len(bodies)


def _decode_compiled(mesh, params, slots, group_size=0):
    """The engine's compiled decode-chunk program on `mesh` for `slots` slots (as `run` builds it)."""
    import jax.numpy as jnp

    from jmarl.sharding import mesh_context

    gen = engine_programs.prepare_program(TINY, False)(params)
    layout = make_layout(TINY, mesh, gen)
    fn = engine_programs.chunk_program(TINY, 4, True, 0, False, (), 0, layout, group_size)
    state = engine_programs.init_program(TINY, slots, slots, 8, N_NEW, layout)()
    with mesh_context(mesh):
        return fn.lower(gen, state, jax.random.key(0), jnp.float32(1), jnp.float32(1), jnp.int32(0)).compile()


@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(data=8), dict(data=4, tensor=2), dict(data=2, fsdp=4)])
def test_engine_on_a_mesh_equals_one_device_with_slots_split(axes, mesh):
    from jmarl import sharding

    prompts = _prompts(12, seed=5)
    stop = _stop_token()
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, stop_tokens=(stop,), chunk_steps=4, num_slots=8)
    want = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(1), spec)
    mesh = mesh(**axes)
    params = sharding.shard_params(models.param_axes(TINY), PARAMS, mesh)  # as the trainer places them (fsdp, tensor)
    got = engine.run(TINY, params, prompts, 2, jax.random.key(1), dataclasses.replace(spec, mesh=mesh))
    for a, b in zip(want.completions, got.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            assert len(ta) > 3
            np.testing.assert_array_equal(tb, ta)
            np.testing.assert_allclose(lb, la, atol=1e-5)
    rows = axes.get("data", 1) * axes.get("fsdp", 1)
    assert got.stats.slots == 8 and got.stats.slots_per_device == 8 // rows
    assert got.stats.entries == rows * budget.entries_for(8 // rows, 2)
    assert got.stats.prefills > 1  # slots were refilled
    if rows == 8:  # one slot per device: a request's second completion reads a copy of its prompt on another device
        assert got.stats.prompts_prefilled > len(prompts)
    # the compiled decode program takes and returns the caches with the slots (and the pool's
    # entries) split over data (x fsdp)
    compiled = _decode_compiled(mesh, params, 8)
    state_in, state_out = compiled.input_shardings[0][1], compiled.output_shardings[0]
    for sh in (state_in.cache.keys[0], state_out.cache.values[1], state_in.pool.cache.keys[0],
               state_out.pool.cache.values[1]):
        shape = (8, TINY.num_kv_heads, TINY.head_dim, N_NEW - 1)
        assert sh.shard_shape(shape)[0] == 8 // rows
        assert sh.shard_shape(shape)[1] == TINY.num_kv_heads // axes.get("tensor", 1)
    # FSDP weights are gathered once per chunk (before the decode loop), not inside the loop
    text = compiled.as_text()
    _assert_loop_bodies_move_nothing(text)
    if "fsdp" in axes:
        assert "all-gather" in text
    # the same with the slots reading their prompts in groups (each device: its own entries)
    _assert_loop_bodies_move_nothing(_decode_compiled(mesh, params, 8, group_size=1).as_text())


@pytest.mark.slow
def test_engine_splits_one_policys_slots_over_the_policy_axis_too(mesh):
    from jmarl import sharding
    from jmarl.train.policies import stack

    prompts = _prompts(12, seed=7)
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, chunk_steps=4, num_slots=8)
    stacked = stack([PARAMS, models.init(TINY, jax.random.key(1))])
    want = engine.run(TINY, stacked, prompts, 2, jax.random.key(2), spec, policy=1)
    mesh = mesh(policy=2, data=2, fsdp=2)
    placed = sharding.shard_params(models.param_axes(TINY), stacked, mesh)  # each policy's on half of the devices
    got = engine.run(TINY, placed, prompts, 2, jax.random.key(2), dataclasses.replace(spec, mesh=mesh), policy=1)
    for a, b in zip(want.completions, got.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(tb, ta)
            np.testing.assert_allclose(lb, la, atol=1e-5)
    # all 8 devices decode: 1 slot each (before, the policy axis held copies of the same 2 slots)
    assert got.stats.slots == 8 and got.stats.slots_per_device == 1
    # a run that fits the slots at once is one program there too: the policy selected, cast and
    # gathered inside it, once, before the decode loop (whose body moves nothing between devices)
    few = _prompts(4, seed=8)
    want = engine.run(TINY, stacked, few, 2, jax.random.key(2), spec, policy=1)
    got = engine.run(TINY, placed, few, 2, jax.random.key(2), dataclasses.replace(spec, mesh=mesh), policy=1)
    assert want.stats.fused == got.stats.fused == 1 and got.stats.slots_per_device == 1
    for a, b in zip(want.completions, got.completions):
        for (ta, la), (tb, lb) in zip(a, b):
            np.testing.assert_array_equal(tb, ta)
            np.testing.assert_allclose(lb, la, atol=1e-5)
    from jmarl.sharding import mesh_context

    layout = make_layout(TINY, mesh, placed, select=True)
    fused = engine_programs.fused_program(TINY, 8, 8, 16, N_NEW, N_NEW, False, 0, False, (), 0, layout, 0, True)
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    with mesh_context(mesh):
        text = fused.lower(placed, np.int32(1), i32(4, 16), np.ones((4, 16), bool), i32(4), *(i32(8),) * 5,
                           jax.random.key(0), np.float32(1), np.float32(1), np.int32(0)).compile().as_text()
    assert "all-gather" in text  # the FSDP-sharded weights, gathered
    _assert_loop_bodies_move_nothing(text)


@pytest.mark.slow
def test_engine_on_data8_equals_static_sampler_budget_per_device_and_sampler_mesh(mesh):
    mesh = mesh(data=8)
    prompts = _prompts(10, seed=6)
    per_row = budget.engine_bytes(TINY, 1, 1, bucket_length(8), N_NEW)
    # budget per device: one slot and one entry each -> 8 slots on 8 devices (one device: 1 slot)
    res = engine.run(TINY, PARAMS, prompts, 1, jax.random.key(1),
                     GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, kv_budget_bytes=per_row, chunk_steps=4,
                                    mesh=mesh))
    assert res.stats.slots == 8 and res.stats.slots_per_device == 1 and res.stats.entries == 8
    for r, prompt in enumerate(prompts):
        tokens, logprobs = _static(prompt, max_new_tokens=N_NEW, temperature=0.0)
        assert len(tokens) > 3
        np.testing.assert_array_equal(res.completions[r][0][0], tokens)
        np.testing.assert_allclose(res.completions[r][0][1], logprobs, atol=1e-5)
    # ModelSampler passes the run's mesh (stacked policies: one policy's slice, slots on data)
    policies = _policy_set()
    requests = [(0, "hi"), (1, "hello there"), (1, "abc")]
    settings = SamplingConfig(max_new_tokens=6, temperature=0.0, engine="continuous", kv_budget_bytes=1 << 20,
                              engine_chunk_steps=4)
    plain = ModelSampler(policies, settings).sample(requests, 2, jax.random.key(0))
    sharded = ModelSampler(policies, settings, mesh=mesh)
    got = sharded.sample(requests, 2, jax.random.key(0))
    for ca, cb in zip(plain, got):
        for x, y in zip(ca, cb):
            assert len(x.completion_tokens) > 3
            np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
    assert sharded.engine_stats.slots_per_device == sharded.engine_stats.slots // 8


@pytest.mark.slow
def test_planned_programs_are_the_ones_run_calls(monkeypatch, mesh):
    """`engine.planned_programs` (what `jmarl.memory_check` compiles) gives the programs `run` calls, with
    arguments of the same shapes, dtypes and shardings."""
    from jmarl import sharding

    mesh = mesh(data=2, fsdp=4)
    params = sharding.shard_params(models.param_axes(TINY), PARAMS, mesh)
    calls = {}

    def recording(name, real):
        def build(*static):
            fn = real(*static)

            def call(*args):
                calls.setdefault(name, (fn, args))
                return fn(*args)

            return call

        return build

    for name, program in (("engine_prefill", "prefill_program"), ("engine_decode", "chunk_program")):
        monkeypatch.setattr(engine_programs, program, recording(name, getattr(engine_programs, program)))
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, num_slots=8, chunk_steps=N_NEW, mesh=mesh)
    # 8 requests x 2 completions in 8 slots (one per device): queued, so refills and drains run (a run
    # that fits the slots at once is one fused program instead, `test_a_run_that_fits_the_slots_is_one_program`),
    # and a request's two completions cannot share a one-slot device's prompts in a group
    res = engine.run(TINY, params, _prompts(8, seed=7, low=8, high=9), 2, jax.random.key(0), spec)
    assert res.stats.fused == 0 and res.stats.grouped_chunks == 0
    monkeypatch.undo()
    p = bucket_length(8)  # the prompts' bucket
    per_row = budget.engine_bytes(TINY, 1, 1, p, N_NEW)
    # one slot and one entry per device's budget
    budgeted = dataclasses.replace(spec, num_slots=None, kv_budget_bytes=per_row)
    assert budget.planned_slots(TINY, p, 8, 1, budgeted) == (8, 8)
    assert budget.planned_slots(TINY, p, 8, 1, spec) == (8, 8)  # num_slots given: as run takes it
    planned = engine.planned_programs(TINY, params, spec, slots=8, entries=8, prompt_len=p)
    assert [name for name, _, _ in planned] == ["engine_prefill", "engine_decode"]
    for name, fn, args in planned:
        real_fn, real_args = calls[name]
        assert fn is real_fn  # the same compiled program (same settings and layout)
        assert jax.tree.structure(args) == jax.tree.structure(real_args)
        for a, r in zip(jax.tree.leaves(args), jax.tree.leaves(real_args)):
            assert a.shape == np.shape(r) and a.dtype == (r.dtype if hasattr(r, "dtype") else np.asarray(r).dtype)
            if a.sharding is not None and isinstance(getattr(r, "sharding", None), jax.sharding.NamedSharding):
                assert a.sharding.is_equivalent_to(r.sharding, len(a.shape))


# ---------------------------------------------------------------------------------- every plan, the trainer
_PATH = dict(size=5, prompt_style="compact", max_turns=2)


@pytest.mark.slow
@pytest.mark.parametrize("plan,env_name,env_options,agent_policy,options", [
    ("independent", "plan_path", _PATH, (0, 1), dict(group_size=2)),
    ("tree", "plan_path", _PATH, (0, 1), dict(group_size=2)),
    ("joint", "writing", {}, (0, 1), dict(group_size=2)),
    ("shared", "math", dict(agents=("solver",), max_turns=1), (0,), dict(group_size=2, num_policies=2)),
    ("node_wise", "plan_path", _PATH, (0, 1), dict(group_size=2, top_k=1)),
])
def test_every_plan_gets_the_same_samples_from_the_engine(plan, env_name, env_options, agent_policy, options):
    from jmarl import envs
    from jmarl.workflows.plans import run_plan

    policies = _policy_set()
    if plan == "shared":  # the run input the shared plan's bind fills: every policy's tokenizer
        options = dict(options, tokenizers={0: policies.groups[0].tokenizer, 1: policies.groups[0].tokenizer})
    env = envs.make(env_name, **env_options)
    seeds = [envs.train_seed(i) for i in range(2)]
    common = dict(max_new_tokens=6, temperature=0.0, max_prompt_len=96)
    static = ModelSampler(policies, SamplingConfig(**common))
    cont = ModelSampler(policies, SamplingConfig(**common, engine="continuous", kv_budget_bytes=1 << 20,
                                                 engine_chunk_steps=4))
    a = run_plan(plan, env, seeds, agent_policy, static, jax.random.key(0), **options)
    b = run_plan(plan, env, seeds, agent_policy, cont, jax.random.key(0), **options)
    assert len(a.records) == len(b.records) > 0
    for x, y in zip(a.records, b.records):
        assert len(x.completion.completion_tokens) > 3
        assert (x.prompt, x.completion.text, x.reward, x.group, x.policy) == (y.prompt, y.completion.text, y.reward,
                                                                             y.group, y.policy)
        np.testing.assert_allclose(y.completion.logprobs, x.completion.logprobs, atol=1e-5)
    assert cont.take_stats()["rollout/row_utilization"] == 1.0


@pytest.mark.slow
def test_trainer_trains_with_the_engine(tmp_path):
    import json

    from test_trainer import _config

    from jmarl.config import load_config
    from jmarl.train import trainer as trainer_mod

    cfg = load_config(_config(tmp_path, "engine"), ["sampling.engine=continuous", "sampling.kv_budget_bytes=1MiB",
                                                    "checkpoint.every=0"])
    trainer_mod.train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "engine" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in steps] == [1, 2] and all(np.isfinite(x["train/loss"]) for x in steps)
    assert all(x["rollout/row_utilization"] == 1.0 and 0 < x["rollout/slot_utilization"] <= 1 for x in steps)


@pytest.mark.slow
def test_both_engines_take_one_spec_and_agree_greedy():
    """One `GenerationSpec` (the trainer's one per run) drives the static sampler and the
    continuous engine; greedy, they give the same completions and log-probs."""
    prompts = _prompts(5, seed=21)
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, stop_tokens=(_stop_token(),), num_slots=2,
                          chunk_steps=3)
    res = engine.run(TINY, PARAMS, prompts, 2, jax.random.key(11), spec)
    tokens, mask = left_pad([p for p in prompts for _ in range(2)], 10, 8, spec.pad_id)
    gen = jax.device_get(static.generate(TINY, PARAMS, tokens, mask, jax.random.key(11), spec))
    for r in range(len(prompts)):
        for j, (got_tokens, got_lp) in enumerate(res.completions[r]):
            row = 2 * r + j
            n = int(gen.lengths[row])
            np.testing.assert_array_equal(got_tokens, gen.tokens[row, :n])
            np.testing.assert_allclose(got_lp, gen.logprobs[row, :n], atol=1e-5)
