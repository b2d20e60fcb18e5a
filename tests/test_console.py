"""The terminal chat loop shared by `quantkit chat` and `quantkit api-client`."""

import io

import pytest

from quantkit.console import chat_loop


class Failed(Exception):
    pass


class Session:
    """Answers with the message reversed; 'fail' raises Failed, 'interrupt' raises KeyboardInterrupt."""

    def __init__(self):
        self.turns, self.clears = [], 0

    def answer(self, text, write):
        if text == "fail":
            raise Failed("the server said no")
        if text == "interrupt":
            write("par")
            raise KeyboardInterrupt
        self.turns.append(text)
        write(text[::-1])
        return text[::-1]

    def clear(self):
        self.clears += 1


def run(lines, **kwargs):
    session, out, err = Session(), io.StringIO(), io.StringIO()
    chat_loop(session, io.StringIO("".join(f"{line}\n" for line in lines)), out, err, **kwargs)
    return session, out.getvalue(), err.getvalue()


def test_answers_clears_and_exits():
    session, out, _ = run(["abc", "", "clear", "xyz", "exit", "never read"])
    assert session.turns == ["abc", "xyz"] and session.clears == 1
    assert "cba" in out and "zyx" in out and "(new conversation)" in out


def test_a_failed_turn_is_one_error_line_and_the_chat_goes_on():
    session, out, err = run(["fail", "ok"], turn_errors=(Failed,))
    assert err == "error: the server said no\n"
    assert session.turns == ["ok"]
    with pytest.raises(Failed):  # errors not named stay errors
        run(["fail"])


def test_ctrl_c_in_an_answer_stops_it_only_when_asked():
    session, out, _ = run(["interrupt", "next"], interrupt_stops_answer=True)
    assert "par [stopped]" in out and session.turns == ["next"]
    with pytest.raises(KeyboardInterrupt):
        run(["interrupt", "next"])
