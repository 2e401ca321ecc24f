"""Router: the routing protocol, function registry, retrieval, memory and rewards by hand."""

import dataclasses

import pytest

from jmarl import JmarlError
from jmarl.envs import make
from jmarl.envs.router import Query, RouterState, calc, convert, retrieve, run_call

KM = Query("How many meters are in 3 kilometers?", "3000", "tool", "CALL convert(3, km, m)")


def test_functions():
    assert calc("sqrt(144) + 7") == "19"
    assert calc("2**3 * 5 - 1") == "39"
    assert calc("7 / 2") == "3.5"
    assert calc("sqrt(2)") == "1.41421"
    for bad in ("__import__('os')", "x + 1", "9**9**9", "1/0", "sqrt(-1)", "1" * 300, "(",
                "[1, 2]", "True + 1"):
        with pytest.raises(ValueError):
            calc(bad)
    assert convert("3", "km", "m") == "3000"
    assert convert("2.5", "h", "min") == "150"
    assert convert("1500", "MG", "g") == "1.5"
    with pytest.raises(ValueError):
        convert("1", "km", "kg")
    assert run_call("Let me call.\nCALL convert(3, 'km', \"m\")") == ("convert(3, 'km', \"m\")",
                                                                      "3000")
    assert run_call("call calc(1+1)") == ("calc(1+1)", "2")
    assert run_call("CALL shell(rm)")[1].startswith("error: unknown function")
    assert run_call("CALL convert(1, km)")[1].startswith("error")
    assert run_call("no call") == (None, None)


def test_retrieval():
    assert retrieve("What is the capital of Kenya?")[0] == "The capital of Kenya is Nairobi."
    assert retrieve("Who wrote Hamlet?", k=1) == ("Hamlet was written by William Shakespeare.",)


def test_episode_rewards_by_hand():
    env = make("router")
    s = RouterState(seed=0, query=KM)
    assert [env.is_active(s, a) for a in env.agents] == [True, False, False, False]
    s, r = env.step(s, "master", "ROUTE: tool")
    # format +0.1, one call -0.1, 2 words * 0.001 -> local -0.002; team 0
    assert r.local_reward == pytest.approx(-0.002) and r.team_reward == 0.0
    assert env.is_active(s, "tool") and not env.is_active(s, "math")
    idle, r = env.step(s, "math", "\\boxed{5}")  # not routed: a no-op
    assert idle == s and r.local_reward == 0.0 and r.info["idle"]
    assert "No request for you" in env.observe(s, "math")
    assert "convert(value, from_unit, to_unit)" in env.observe(s, "tool")
    s, r = env.step(s, "tool", "CALL convert(3, km, m)")
    # format +0.1; words CALL convert 3 km m = 5 -> -0.005 -> local 0.095
    assert r.local_reward == pytest.approx(0.095)
    assert s.results == ("tool: convert(3, km, m) = 3000",)
    s = env.end_turn(s)
    assert "tool: convert(3, km, m) = 3000" in env.observe(s, "master")
    s, r = env.step(s, "master", "FINAL: 3000")
    # format +0.1, 2 words -> -0.002: local 0.098; accuracy 1 -> team 1
    assert r.local_reward == pytest.approx(0.098) and r.team_reward == 1.0 and r.done
    assert env.success(s) and env.done(s)


def test_wrong_malformed_and_direct_answers():
    env = make("router")
    s = RouterState(seed=0, query=KM)
    same, r = env.step(s, "master", "I am not sure what to do")
    # no format: 0; cost 7 words (I am not sure what to do) -> -0.007; state unchanged
    assert r.local_reward == pytest.approx(-0.007) and same == s and not r.info["format_ok"]
    done, r = env.step(s, "master", "FINAL: 300")
    assert r.team_reward == 0.0 and r.done and not env.success(done)
    s2, r = env.step(s, "master", "ROUTE: qa")
    s2, r = env.step(s2, "qa", "I don't know")  # no ANSWER: -> no format reward
    # 3 words (i, don't, know) -> -0.003
    assert r.local_reward == pytest.approx(-0.003) and s2.results == ("qa: no answer",)
    s3, r = env.step(s, "master", "ROUTE: math")
    s3, r = env.step(s3, "math", "\\boxed{3000}")
    assert r.info["format_ok"] and s3.results == ("math: 3000",)
    # the later of ROUTE/FINAL wins
    _, r = env.step(s, "master", "ROUTE: tool\nActually FINAL: 3000")
    assert r.done and r.team_reward == 1.0


def test_unanswered_route_expires_and_turn_limit():
    env = make("router", max_turns=2)
    s = RouterState(seed=0, query=KM)
    s, _ = env.step(s, "master", "ROUTE: tool")
    s = env.end_turn(s)  # the tool agent never acted this turn
    assert s.route is None and not env.is_active(s, "tool")
    s, _ = env.step(s, "master", "ROUTE: math")
    s = env.end_turn(s)
    assert env.done(s) and not env.success(s) and s.calls == 2


def test_memory_block_and_options():
    env = make("router")
    s = dataclasses.replace(env.reset(1), memory_context={"master": ("unit questions -> tool",)})
    assert "Relevant memory:\n- unit questions -> tool" in env.observe(s, "master")
    with pytest.raises(JmarlError, match="max_turns"):
        make("router", max_turns=1)
    with pytest.raises(JmarlError, match="unknown agent"):
        env.observe(s, "boss")


def test_query_mix_and_expert_routes():
    env = make("router")
    routes = [env.solution(s)[0] for s in range(300)]
    assert {r: routes.count(r) > 50 for r in ("math", "tool", "qa")} == {
        "math": True, "tool": True, "qa": True}
