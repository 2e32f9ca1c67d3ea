"""Every command's --help: whole sentences, every option explained, no empty default."""

from __future__ import annotations

import argparse

import pytest

from bdh_train.cli import COMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_top_level_help_names_every_command_in_whole_sentences():
    text = build_parser().format_help()
    description = build_parser().description or ""
    assert description.endswith(".") and "inspect" in description, description
    for name in COMMANDS:
        assert name in description and name in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_of_every_command_says_what_it_does(name):
    parser = _subparsers()[name]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}"
    text = parser.format_help()
    assert "(default: )" not in text and "(default: [])" not in text, text


def test_prepare_vocab_size_says_it_has_no_default():
    (action,) = (a for a in _subparsers()["prepare"]._actions if a.dest == "vocab_size")
    assert action.help and "no default" in action.help
