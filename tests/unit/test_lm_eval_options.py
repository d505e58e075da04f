"""lm-eval's --tasks and --file without running lm-eval (fast): which tasks a command asks for, the line for
an unknown task name and for a hub task whose data is not here, the user's file read as a corpus with its
one-line errors, and the perplexity task over it (the local Rotten Tomatoes one's, on other documents).
tests/unit/test_lm_eval.py (slow) runs them through lm-eval."""

import json

import pytest

from dynmoe_dist.experiments import lmeval


def test_the_tasks_asked_for():
    assert lmeval.requested_tasks(None, None) == list(lmeval.TASKS)  # the two local tasks by default
    assert lmeval.requested_tasks(None, "my.jsonl") == [lmeval.FILE_TASK]
    assert lmeval.requested_tasks("hellaswag, arc_easy", "my.txt") == ["hellaswag", "arc_easy", lmeval.FILE_TASK]
    with pytest.raises(ValueError, match=r"--tasks \('hellaswag,,arc_easy'\) has an empty name"):
        lmeval.requested_tasks("hellaswag,,arc_easy", None)


def test_an_unknown_task_lists_the_close_names():
    installed = ["hellaswag", "hellaswag_de", "arc_easy", "arc_challenge", "lambada_openai"]
    lmeval.check_task_names(["arc_easy", "hellaswag"], installed)
    with pytest.raises(ValueError) as err:
        lmeval.check_task_names(["arc_easy", "hellaswg"], installed)
    assert (
        str(err.value)
        == "--tasks: 'hellaswg' is not an lm-eval task installed here (close names: hellaswag, hellaswag_de)"
    )
    with pytest.raises(
        ValueError, match=r"'zzz' is not an lm-eval task installed here \(no installed task has a close"
    ):
        lmeval.check_task_names(["zzz"], installed)


def test_a_hub_task_without_its_data_is_one_line():
    class Offline:
        def load(self, names):
            if names == ["lambada_openai"]:
                raise ConnectionError(
                    "Couldn't reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)\nmore"
                )

    lmeval.check_data_is_here([lmeval.FILE_TASK], Offline())
    with pytest.raises(ValueError) as err:
        lmeval.check_data_is_here([lmeval.FILE_TASK, "lambada_openai"], Offline())
    line = str(err.value)
    assert "\n" not in line and line.startswith("--tasks: 'lambada_openai' reads its data from the Hugging Face hub")
    assert "(Couldn't reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled))" in line
    assert "--file" in line


def test_the_file_is_read_as_a_corpus(tmp_path):
    (tmp_path / "notes.txt").write_text("the cat sat\n\n  a dog ran  \n")
    assert lmeval.file_documents(str(tmp_path / "notes.txt"), "text", tmp_path / "cache") == [
        "the cat sat",
        "a dog ran",
    ]
    rows = [{"body": "first doc", "id": 1}, {"body": "second doc", "id": 2}]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert lmeval.file_documents(str(tmp_path / "held.jsonl"), "body", tmp_path / "cache") == [
        "first doc",
        "second doc",
    ]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("held.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"held.jsonl:2: no key 'text' \(--text-field\)"),
        ("empty.txt", "\n\n", r"--file \('.*empty.txt'\) holds no text"),
        ("notes.csv", "a,b\n", r"--file \('.*notes.csv'\) must be a .txt / .jsonl"),
    ],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        lmeval.file_documents(str(tmp_path / name), "text", tmp_path / "cache")
    with pytest.raises(ValueError, match=r"--file \('.*nothing.jsonl'\) does not exist"):
        lmeval.file_documents(str(tmp_path / "nothing.jsonl"), "text", tmp_path / "cache")


def test_the_file_task_is_the_local_perplexity_task_over_the_users_documents(tmp_path):
    import yaml

    lmeval.write_file_task(tmp_path, ["first doc", "second doc"])
    data = (tmp_path / lmeval.FILE_DATA).resolve()
    assert [json.loads(line) for line in data.read_text().splitlines()] == [
        {"text": "first doc"},
        {"text": "second doc"},
    ]
    task = yaml.safe_load((tmp_path / f"{lmeval.FILE_TASK}.yaml").read_text())
    rotten = lmeval.task_yamls(data)[lmeval.PERPLEXITY_TASK]
    assert task == {**rotten, "task": lmeval.FILE_TASK}
    assert task["output_type"] == "loglikelihood_rolling" and task["doc_to_target"] == "{{text}}"
