"""The accuracy tasks as lm-evaluation-harness's stock definitions (0.4.x) state them: for each document the
same prompt text, choices and gold answer, so `acc` and `acc_norm` mean what users read on model cards.

A document is a list of (context, continuation) strings, one per choice, whose log-likelihoods are compared:
- multiple choice (hellaswag, arc_easy, arc_challenge, piqa, mmlu): one context, each choice the continuation
  after the target delimiter " ";
- partial scoring (winogrande): the option fills the blank inside the context, and the shared rest of the
  sentence is the continuation scored;
- yes/no (boolq): " no" and " yes" after "Answer:".
`norm_lengths` are what lm-eval's acc_norm divides each log-likelihood by: the characters of each choice.
MMLU is one task over its 57 subjects (`--limit N`: the first N of each), its description line first and with
`--num-fewshot K` the first K documents of each subject's dev split as solved examples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from quantkit.config import UserError
from quantkit.eval.task_data import data_root, read_split

DELIMITER = " "  # lm-eval's target_delimiter
FEWSHOT_DELIMITER = "\n\n"


@dataclass(frozen=True)
class TaskDoc:
    """One document: the (context, continuation) pair of each choice, the gold choice, acc_norm's divisors,
    and the subject it belongs to (MMLU; lm-eval pools the standard error over subjects)."""

    requests: tuple[tuple[str, str], ...]
    gold: int
    norm_lengths: tuple[int, ...]
    group: str = ""


def _choices_doc(context: str, choices: list[str], gold: int, group: str = "") -> TaskDoc:
    return TaskDoc(tuple((context, DELIMITER + c) for c in choices), gold, tuple(len(c) for c in choices), group)


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)  # WikiHow's bracketed artifacts
    return text.replace("  ", " ")


def hellaswag(doc: dict) -> TaskDoc:
    context = _hellaswag_text(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    return _choices_doc(context, [_hellaswag_text(e) for e in doc["endings"]], int(doc["label"]))


def arc(doc: dict) -> TaskDoc:
    choices = doc["choices"]
    return _choices_doc(f"Question: {doc['question']}\nAnswer:", list(choices["text"]),
                        list(choices["label"]).index(doc["answerKey"]))


def piqa(doc: dict) -> TaskDoc:
    return _choices_doc(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]))


def winogrande(doc: dict) -> TaskDoc:
    sentence = doc["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + option for option in (doc["option1"], doc["option2"])]
    continuation = DELIMITER + sentence[blank + 1:].strip()
    return TaskDoc(tuple((c, continuation) for c in contexts), {"1": 0, "2": 1}[doc["answer"]],
                   tuple(len(c) for c in contexts))


def boolq(doc: dict) -> TaskDoc:
    gold = int(doc["label"]) if "label" in doc else int(bool(doc["answer"]))  # super_glue's label, google's answer
    return _choices_doc(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:", ["no", "yes"], gold)


MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology high_school_statistics "
    "high_school_us_history high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous moral_disputes "
    "moral_scenarios nutrition philosophy prehistory professional_accounting professional_law professional_medicine "
    "professional_psychology public_relations security_studies sociology us_foreign_policy virology "
    "world_religions").split()
MMLU_LETTERS = ("A", "B", "C", "D")


def mmlu_question(doc: dict) -> str:
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(MMLU_LETTERS, doc["choices"]))
    return f"{doc['question'].strip()}{options}\nAnswer:"


def mmlu(doc: dict, subject: str, shots: list[dict]) -> TaskDoc:
    header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    solved = "".join(mmlu_question(s) + DELIMITER + MMLU_LETTERS[int(s["answer"])] + FEWSHOT_DELIMITER for s in shots)
    return _choices_doc(header + solved + mmlu_question(doc), list(MMLU_LETTERS), int(doc["answer"]), subject)


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's documents are (under the data root) and how one becomes a `TaskDoc`; `metrics` are what
    lm-eval reports for it, `headline` the one comparisons show."""

    name: str
    split: str
    to_doc: Optional[Callable[[dict], TaskDoc]]
    metrics: tuple[str, ...] = ("acc", "acc_norm")

    @property
    def headline(self) -> str:
        return self.metrics[-1]


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("hellaswag", "hellaswag/none/validation", hellaswag),
    TaskSpec("arc_easy", "ai2_arc/ARC-Easy/validation", arc),
    TaskSpec("arc_challenge", "ai2_arc/ARC-Challenge/validation", arc),
    TaskSpec("piqa", "piqa/plain_text/validation", piqa),
    TaskSpec("winogrande", "winogrande/winogrande_xl/validation", winogrande, ("acc",)),
    TaskSpec("boolq", "boolq/none/validation", boolq, ("acc",)),
    TaskSpec("mmlu", "hails/mmlu_no_train/{subject}/test", None, ("acc",)),
)}
MMLU_FEWSHOT_SPLIT = "hails/mmlu_no_train/{subject}/dev"
DEFAULT_TASKS = tuple(TASKS)


def parse_tasks(names: str | list[str]) -> list[TaskSpec]:
    """Task specs from "hellaswag,arc_easy" (or a list of such strings), each once, in the order given."""
    parts = [n.strip() for item in ([names] if isinstance(names, str) else names) for n in item.split(",")]
    parts = list(dict.fromkeys(p for p in parts if p))
    unknown = [p for p in parts if p not in TASKS]
    if unknown or not parts:
        raise UserError(f"unknown task {', '.join(map(repr, unknown)) or '(none given)'}: choose among "
                        f"{', '.join(TASKS)} (comma-separated)")
    return [TASKS[p] for p in parts]


def check_settings(limit: Optional[int], num_fewshot: int, specs: list[TaskSpec]) -> None:
    """Refuse a negative limit or shot count, and shots where no split to draw them from is shipped."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit} must be ≥ 1 (documents per task; MMLU: per subject), or left out for all")
    if num_fewshot < 0:
        raise UserError(f"--num-fewshot {num_fewshot} must be ≥ 0")
    if num_fewshot > 5:
        raise UserError(f"--num-fewshot {num_fewshot}: MMLU's dev split holds 5 documents per subject; choose 0–5")
    others = [s.name for s in specs if s.name != "mmlu"]
    if num_fewshot and others:
        raise UserError(f"--num-fewshot {num_fewshot} applies to mmlu only (its dev split); the data holds no "
                        f"training split of {', '.join(others)}: run those with --num-fewshot 0")


def load_docs(spec: TaskSpec, limit: Optional[int] = None, num_fewshot: int = 0,
              data_dir: Optional[str] = None) -> list[TaskDoc]:
    """The task's documents in the split's order, the first `limit` (MMLU: of each subject, subjects in
    alphabetical order)."""
    root = data_root(data_dir)
    read = lambda rel: read_split(root, rel, from_package=data_dir is None)  # noqa: E731
    if spec.to_doc is not None:
        return [spec.to_doc(d) for d in read(spec.split)[:limit]]
    docs = []
    for subject in MMLU_SUBJECTS:
        shots = read(MMLU_FEWSHOT_SPLIT.format(subject=subject))[:num_fewshot] if num_fewshot else []
        docs += [mmlu(d, subject, shots) for d in read(spec.split.format(subject=subject))[:limit]]
    return docs
