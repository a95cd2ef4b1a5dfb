"""``pacing.Share``: which parts go when, against the share the server tells."""

from __future__ import annotations

import grpc
from logprob_client.pacing import PacedCall, Share


class Parts:
    """A share whose parts record that they went, and how often it asked for the limits."""

    def __init__(self) -> None:
        self.asked = 0
        self.share = Share(self._learn)
        self.sent: list[str] = []

    def _learn(self) -> None:
        self.asked += 1

    def ask(self, name: str, cost: int):
        return self.share.ask(cost, lambda: self.sent.append(name))


def test_a_lone_call_goes_at_once_and_a_second_part_asks_for_the_share_once():
    parts = Parts()
    assert parts.ask("a", 500) is None and parts.sent == ["a"]
    assert parts.asked == 0  # a lone part never asks
    assert parts.ask("b", 10) is not None and parts.ask("c", 10) is not None
    assert parts.sent == ["a"] and parts.asked == 1  # kept back until the share is known
    parts.share.told(4000, 800)
    assert parts.sent == ["a"]  # a's 500 tokens pass the budget (400) already
    parts.share.release(500)
    assert parts.sent == ["a", "b", "c"] and parts.asked == 1


def test_parts_are_kept_within_half_the_share_and_sent_in_order_as_others_end():
    parts = Parts()
    parts.share.told(max_queued_tokens=4000, max_queued_tokens_per_client=800)
    assert parts.share.budget == 400
    parts.ask("a", 300)
    parts.ask("b", 300)  # 600 > 400: kept back
    parts.ask("c", 50)  # fits, but waits its turn behind b
    assert parts.sent == ["a"]
    parts.share.release(300)
    assert parts.sent == ["a", "b", "c"] and parts.share.in_flight == 350


def test_a_part_larger_than_the_budget_goes_alone():
    parts = Parts()
    parts.share.told(4000, 800)
    parts.ask("a", 100)
    parts.ask("big", 700)  # more than the budget (400), within the share: the server admits it alone
    assert parts.sent == ["a"]
    parts.share.release(100)
    assert parts.sent == ["a", "big"] and parts.share.in_flight == 700
    parts.ask("c", 10)
    assert parts.sent == ["a", "big"]
    parts.share.release(700)
    assert parts.sent == ["a", "big", "c"]


def test_a_server_that_tells_no_share_leaves_the_parts_unpaced():
    parts = Parts()
    parts.ask("a", 10**6)
    waiting = parts.ask("b", 10**6)
    parts.share.told(0, 0)  # a server before the fields
    assert parts.sent == ["a", "b"] and waiting is not None
    parts.ask("c", 10**6)
    assert parts.sent == ["a", "b", "c"] and parts.share.budget == 0


def test_the_smaller_of_the_queue_and_the_share_paces():
    parts = Parts()
    parts.share.told(max_queued_tokens=600, max_queued_tokens_per_client=800)
    assert parts.share.budget == 300 and parts.share.limit_name == "max_queued_tokens"


def test_a_withdrawn_part_makes_room_for_those_behind_it():
    parts = Parts()
    parts.share.told(4000, 800)
    parts.ask("a", 300)
    b = parts.ask("b", 300)
    parts.ask("c", 50)
    assert parts.share.withdraw(b)
    assert parts.sent == ["a", "c"]
    assert not parts.share.withdraw(b)  # gone already


def test_the_deadline_error_counts_what_was_done_and_names_the_share():
    parts = Parts()
    parts.share.told(4000, 800)
    call = PacedCall(costs=[80, 80, 80], sequences=[2, 2, 2], timeout=1.5)
    call.sent |= {0, 1}
    call.answered.add(0)
    error = call.deadline_error("'127.0.0.1:1'", parts.share, "Deadline Exceeded")
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(error) == (
        "DEADLINE_EXCEEDED: '127.0.0.1:1': the call's deadline (1.5 s) passed with 1 of 3 parts answered "
        "(2 of 6 sequences, 80 of 240 tokens), 1 sent and not yet answered, 1 not sent; parts were paced to this "
        "client's share of the server's queue, max_queued_tokens_per_client=800 tokens (ListModels): at most 400 "
        "tokens of its parts in flight at once, the next part sent as earlier ones were answered; give the call a "
        "longer timeout, send less in one call, or raise the server's max_queued_tokens_per_client"
    )
