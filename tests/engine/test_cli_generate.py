"""The ``kvharbor`` console script: ``kvharbor generate`` prints what the engine generates, one
line per prompt; bad arguments get a message and exit code 2; the tenants and dashboards
command groups hang off the same parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.cli import main

PROMPTS = ["Hello", "The capital of France is"]


def test_generate_prints_the_engines_text_one_line_per_prompt(capsys):
    assert main(["generate", *PROMPTS, "--max-tokens", "6", "--seed", "3", "--temperature", "0.8",
                 "--top-p", "0.9"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(model="kvharbor/tiny-llama", device="auto")         # as the CLI
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    expected = [out.text for out in llm.generate(PROMPTS, params)]
    assert printed == "".join(text + "\n" for text in expected)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    assert expected != [out.text for out in llm.generate(PROMPTS, greedy)]   # sampling reached it


@pytest.mark.parametrize("argv, words", [
    (["generate", "Hello", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["generate", "Hello", "--top-p", "1.5"], "top_p"),
])
def test_bad_generation_arguments_are_a_message_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err


def test_the_tenants_and_dashboards_groups_run_from_the_console_script(tmp_path, capsys):
    checked_in = Path(__file__).resolve().parents[2] / "dashboards"
    assert main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.glob("*.json")} == {p.name for p in checked_in.glob("*.json")}
    assert main(["tenants"]) == 2 and "validate" in capsys.readouterr().out
