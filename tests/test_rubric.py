"""Rubric table tests: the grammar, its verdicts, and hostile inputs."""

import pytest

from reprorl.pipeline.rubric import (
    ACTIONS,
    CLOSERS,
    GESTURES,
    OPENERS,
    REFUSALS,
    SENTENCES,
    evaluate_response,
    response,
)

WIFI = 3  # re-enable Wi-Fi


def verdict(text, finish="eos", expected=WIFI):
    return evaluate_response(text, finish, expected)


def test_grammar_size_and_canonical_forms():
    assert len(SENTENCES) == 666  # 74 bodies x (1 + 2 openers) x (1 + 2 closers)
    for action in range(len(ACTIONS)):
        for certainty in range(3):
            for polite in (False, True):
                result = verdict(response(action, certainty, polite), expected=action)
                assert result["recognized"] and result["polite"] == polite
                assert result["rubric_success"] == (certainty < 2)
                assert result["unsupported_certainty"] == (certainty == 2)


@pytest.mark.parametrize(
    "text, success, reason",
    [
        ("Next step: re-enable Wi-Fi.", True, "success"),
        ("It may help to turn Wi-Fi back on.", True, "success"),
        ("You could try to re-enable Wi-Fi.", True, "success"),
        ("Next step: save the open document.", False, "wrong_gesture"),
        ("Re-enable Wi-Fi; this is guaranteed to fix it.", False, "unsupported_certainty"),
        ("I cannot help with this request.", False, "refusal"),
        # case and whitespace changes are the same sentence
        ("  NEXT step:\tre-enable wi-fi.  ", True, "success"),
        ("next step:  re-enable\nWi-Fi.", True, "success"),
        # politeness does not change success
        ("Sorry for the inconvenience. Next step: re-enable Wi-Fi. Have a nice day.", True,
         "success"),
    ],
)
def test_recognized_table(text, success, reason):
    result = verdict(text)
    assert result["recognized"] and result["status"] == ("PASS" if success else "FAIL")
    assert result["rubric_success"] is success and result["reason"] == reason


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("   \n\t ", "empty"),
        ("Next step: re-enable Wi-Fi. Next step: save the open document.", "several_gestures"),
        ("Next step: re-enable Wi-Fi. asdf qwerty", "gesture_with_text_outside_grammar"),
        ("Next step: re-enable Wi-Fi", "gesture_with_text_outside_grammar"),  # no full stop
        ("I cannot help with this request. Next step: re-enable Wi-Fi.", "refusal_with_gesture"),
        ("Reboot the router and everything will work.", "not_in_grammar"),
        ("Next step: re-enable Wi-Fi. 🙂", "gesture_with_text_outside_grammar"),
        ("Próximo paso: reactivar el Wi-Fi.", "not_in_grammar"),
        ("Next step: re-enable Wi-Fi.\ufffd", "undecodable"),
    ],
)
def test_uncertified_table(text, reason):
    result = verdict(text)
    assert result["status"] == "UNCERTIFIED" and result["reason"] == reason
    assert not result["recognized"] and not result["rubric_success"]
    assert result["unsupported_certainty"] is None  # no denominator contribution
    assert not result["polite"] and not result["refusal"]


def test_cut_response_never_succeeds():
    result = verdict("Next step: re-enable Wi-Fi.", finish="length")
    assert not result["rubric_success"] and result["reason"] == "cut_without_eos"


def test_full_width_and_compatibility_forms_normalise():
    # NFKC folds full-width letters and the non-breaking space into their plain forms
    result = verdict("Ｎｅｘｔ step:\u00a0re-enable Wi-Fi.")
    assert result["rubric_success"]


def test_expected_action_is_checked():
    with pytest.raises(ValueError, match="expected_action"):
        evaluate_response("Next step: re-enable Wi-Fi.", "eos", 6)


def test_grammar_parts_are_distinct():
    phrases = [p.casefold() for forms in GESTURES for p in forms]
    assert len(set(phrases)) == len(phrases)
    assert len({*OPENERS, *CLOSERS, *REFUSALS}) == 6
