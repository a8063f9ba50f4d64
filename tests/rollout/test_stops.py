"""The pure stop-string matcher of the calls server: the first token whose decoded text completes a stop string,
found from a tail of the completion only, across a resume point."""

from services.rollout.engine.stops import SLACK, first_stop

VOCAB = ["he", "llo", " w", "or", "ld", "!", "", "<s>", "x"]


def decoder(calls: list[int] | None = None):
    def decode(ids: list[int]) -> str:
        if calls is not None:
            calls.append(len(ids))
        # id 6 decodes to nothing (a special token, skipped)
        return "".join(VOCAB[i] for i in ids)

    return decode


def test_the_token_that_completes_the_string_is_found():
    ids = [0, 1, 2, 3, 4, 5]
    assert first_stop(decoder(), ids, 0, ["o wor"]) == (3, "o wor")
    assert first_stop(decoder(), ids, 0, ["lo w", "xyz"]) == (2, "lo w")
    assert first_stop(decoder(), ids, 0, ["world!?"]) is None
    assert first_stop(decoder(), ids, 0, []) is None


def test_a_string_straddling_the_resume_point_stops_at_its_last_token():
    # tokens 0-2 logged before an abort ("hello w"), 3-4 generated after the resume
    assert first_stop(decoder(), [0, 1, 2, 3, 4], 3, ["wor"]) == (3, "wor")
    assert first_stop(decoder(), [0, 1, 2, 3, 4], 3, ["hello world"]) == (4, "hello world")


def test_of_strings_completed_by_one_token_the_one_starting_first_wins():
    assert first_stop(decoder(), [0, 1, 2, 3], 0, ["or", "lo wor"]) == (3, "lo wor")


def test_tokens_that_decode_to_nothing_widen_the_window():
    ids = [0, 1] + [6] * 20 + [2, 3]
    assert first_stop(decoder(), ids, 0, ["llo wor"]) == (len(ids) - 1, "llo wor")


def test_only_a_tail_is_decoded_per_token():
    calls: list[int] = []
    ids = [8] * 500 + [0, 1]
    assert first_stop(decoder(calls), ids, 0, ["hello"]) == (501, "hello")
    assert max(calls) <= len("hello") + SLACK
