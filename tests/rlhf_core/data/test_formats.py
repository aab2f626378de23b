import pytest

from rlhf_core.data.formats import DataFormatError, message_problem, split_shared_prefix, to_explicit


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}


def test_standard_rows_pass_through_unchanged():
    rows = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": "a"}]
    out = to_explicit(rows)
    assert (out.format, out.implicit_prompt, out.rows) == ("standard", False, rows)


def test_conversational_rows_keep_their_messages():
    rows = [{"prompt": [SYSTEM, user("Sky colour?")], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}]
    out = to_explicit(rows)
    assert (out.format, out.implicit_prompt, out.rows) == ("conversational", False, rows)


def test_an_implicit_conversation_splits_at_the_first_message_that_differs():
    shared = [user("Hi"), assistant("Hello!"), user("Sky colour?")]
    out = to_explicit([{"chosen": shared + [assistant("Blue.")], "rejected": shared + [assistant("Green.")]}])
    assert out.implicit_prompt and out.format == "conversational"
    assert out.rows == [{"prompt": shared, "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}]


def test_an_implicit_text_splits_before_the_space_as_trl_does():
    # TRL's extract_prompt: the responses start with the space, the prompt has none at its end
    assert split_shared_prefix("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert split_shared_prefix("2+2=4", "2+2=5") == ("2+2=", "4", "5")
    out = to_explicit([{"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"}])
    assert out.rows == [{"prompt": "Q: sky? A:", "chosen": " blue", "rejected": " green"}]


def test_split_matches_a_slow_reference_on_random_texts():
    import random

    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 8)))
        b = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 8)))
        prompt, ca, cb = split_shared_prefix(a, b)
        assert prompt + ca == a and prompt + cb == b
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        expected = common - 1 if common > 0 and a[common - 1] == " " else common  # one space goes to the responses
        assert len(prompt) == expected


@pytest.mark.parametrize(
    "messages, prompt, problem",
    [
        ([user("a"), user("b")], True, "turn 1 is 'user' where 'assistant' was expected"),
        ([assistant("a")], True, "turn 0 is 'assistant' where 'user' was expected"),
        ([user("a"), assistant("b")], True, "a prompt must end with a user turn"),
        ([user("a"), SYSTEM], True, "message 1: a system message may only come first"),
        ([{"role": "bot", "content": "x"}], True, "message 0 has role 'bot'"),
        ([{"role": "user"}], True, "message 0 must have the keys role and content"),
        ([{"role": "user", "content": 3}], True, "message 0 content must be a string"),
        ([], True, "non-empty list"),
        ("a string", True, "non-empty list"),
        ([assistant("  ")], False, "an assistant turn is empty"),
        ([assistant("a"), user("b")], False, "a response must end with an assistant turn"),
        ([user("a")], False, "turn 0 is 'user' where 'assistant' was expected"),
    ],
)
def test_malformed_conversations_are_named(messages, prompt, problem):
    assert problem in message_problem(messages, prompt=prompt)


def test_well_formed_conversations_have_no_problem():
    assert message_problem([SYSTEM, user("a"), assistant("b"), user("c")], prompt=True) is None
    assert message_problem([assistant("b")], prompt=False) is None
    assert message_problem([assistant("b"), user("more?"), assistant("c")], prompt=False) is None


def test_roles_out_of_order_are_rejected_with_row_and_column():
    rows = [
        {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]},
        {"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [user("c")]},
    ]
    with pytest.raises(DataFormatError) as exc:
        to_explicit(rows)
    assert (exc.value.row, exc.value.column) == (1, "rejected")
    assert str(exc.value).startswith("row 1, column 'rejected': turn 0 is 'user'")


def test_an_implicit_prompt_that_is_not_shared_is_rejected():
    with pytest.raises(DataFormatError, match="row 0, column 'chosen': shares no prompt"):
        to_explicit([{"chosen": [assistant("x")], "rejected": [user("y"), assistant("z")]}])
    with pytest.raises(DataFormatError, match="shares no prompt"):
        to_explicit([{"chosen": "blue", "rejected": "green"}])


def test_an_implicit_conversation_that_differs_at_a_user_turn_is_rejected():
    chosen = [user("a"), assistant("b"), user("c"), assistant("d")]
    rejected = [user("a"), assistant("b"), user("C"), assistant("d")]
    with pytest.raises(DataFormatError, match="row 0, column 'prompt': a prompt must end with a user turn"):
        to_explicit([{"chosen": chosen, "rejected": rejected}])


def test_one_file_holds_one_format():
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": [user("a")], "chosen": "b", "rejected": "c"}]
    with pytest.raises(DataFormatError, match="row 1, column 'prompt': must be a string, as in the first row, got list"):
        to_explicit(rows)
    with pytest.raises(DataFormatError, match="row 1, column 'prompt': present, but the first row has none"):
        to_explicit([{"chosen": "a b", "rejected": "a c"}, {"prompt": "a", "chosen": " b", "rejected": " c"}])
    with pytest.raises(DataFormatError, match="row 0, column 'rejected': missing"):
        to_explicit([{"prompt": "a", "chosen": "b"}])
