"""An instance's role while it serves: what a switch needs, what it refuses and why, and that a
switched instance keeps serving the work of its old role (a prefill's hand-off whose decode side
became a prefill instance meanwhile still lands and decodes). Real Redis, the stub model."""

from __future__ import annotations

from router_support import run
from splitwise_support import pair, settle, token_for

from pdserve.scheduler import SetRole
from pdserve.worker.roles import RoleState


def state(role: str, shared: bool = False, transports: bool = True, switchable: bool = False) -> RoleState:
    return RoleState(
        role, shared_cache=shared, transports=lambda: transports, now=lambda: 42.0, switchable=switchable
    )


def ask(role: str, n: int = 0) -> SetRole:
    return SetRole(request_id=f"switch-{n}", role=role, reason="test")  # type: ignore[arg-type]


def test_a_switch_takes_the_role_and_records_it() -> None:
    roles = state("decode", shared=True)
    done = roles.switch(ask("prefill"))
    assert (done.ok, done.error, roles.role) == (True, None, "prefill")
    assert [(c.role, c.at, c.reason) for c in roles.history] == [("prefill", 42.0, "test")]
    assert roles.switch(ask("decode", 1)).ok and roles.role == "decode"
    assert roles.last_switch is not None and roles.last_switch.id == "switch-1"


def test_a_switch_its_start_did_not_prepare_for_is_refused_with_the_reason() -> None:
    prefill = state("prefill", shared=False)  # a prefill's cache is not in shared memory
    done = prefill.switch(ask("decode"))
    assert not done.ok and "--switchable" in (done.error or "") and prefill.role == "prefill"
    mixed = state("mixed", transports=False)
    assert "no KV transport" in (mixed.switch(ask("prefill")).error or "")
    assert mixed.switch(ask("mixed", 1)).ok  # the role it has: nothing to do, and said so
    draining = state("decode", shared=True)
    assert draining.switch(ask("prefill"), draining=True).error == "it is draining"


def test_a_decode_instance_switched_to_prefill_still_takes_the_hand_off_it_reserved(redis_url) -> None:
    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            prompt = list(range(1, 11))
            await p.send(prefill, p.request(prompt, max_tokens=4))
            await prefill.receive()
            await decode.receive()  # its lease is taken
            switched = []

            async def published() -> None:
                switched.append(decode.handler.role)

            decode.handler.roles = state("decode", shared=True)
            decode.handler.on_role_change = published
            await p.send(decode, ask("prefill"))
            await decode.receive()
            assert decode.handler.role == "prefill" and switched == ["prefill"]
            await settle(prefill, decode)  # the write lands, the lease's request decodes to its end
            events = await p.events()
            assert [t for e in events for t in e.token_ids] == [token_for(prompt, i) for i in range(4)]
            assert events[-1].finish_reason == "length" and events[-1].error is None

    run(main())
