"""Settings the model or the ranks at hand cannot run are found when a component starts, after the config
validated. They are the user's to fix, so they are ``SettingError`` (a ``UserError``): a rank reports them as one
``relayrl: error:`` line naming the key, where a plain ``ValueError`` was printed as the rank's traceback (twice).
The static decoder and the native engine's cache check are tested in tests/models/test_architectures.py."""

from __future__ import annotations

import pytest

from relayrl.errors import SettingError, is_user_error, user_message


def test_a_teacher_with_another_tokenizer_is_a_user_error(tmp_path, tiny_tokenizer):
    from relayrl.workflows.roles import check_teacher

    tiny_tokenizer.save_pretrained(tmp_path / "student")
    other = type(tiny_tokenizer).from_pretrained(tmp_path / "student")
    other.add_tokens(["<|not-the-students|>"])
    other.save_pretrained(tmp_path / "teacher")
    check_teacher(str(tmp_path / "student"), tiny_tokenizer)  # (the same tokenizer: taken)
    with pytest.raises(SettingError) as e:
        check_teacher(str(tmp_path / "teacher"), tiny_tokenizer)
    assert is_user_error(e.value)
    assert user_message(e.value).startswith(f"algorithm.distill.teacher='{tmp_path / 'teacher'}' has a tokenizer "
                                            f"other than the student's")


def test_a_setting_error_is_still_a_value_error():
    # (callers and tests that catch ValueError keep working)
    assert issubclass(SettingError, ValueError) and is_user_error(SettingError("engine.x: ..."))
