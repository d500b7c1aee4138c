"""Verifiable tasks for RL post-training: problems generated locally from a seed, and rewards computed from the
(prompt, response) strings alone.

A task makes `Problem`s (a prompt and one correct response, the latter only for the SFT warm start) and scores a
response with an exact-match reward, 1.0 or 0.0. The reward re-derives everything it needs from the prompt, so
the built-in rewards have the same signature as a user's reward function: `reward(prompt, response) -> float`.

* `arithmetic`: sums and differences of 2..max_terms integers of 1..max_digits digits, `"47+8-160="` -> `"-105"`.
* `countdown`: reach a target with some of the given numbers and + - * (each number at most once, parentheses
  allowed), `"3 7 25>46:"` -> `"25+3*7"` (or any other expression that evaluates to 46).
* `expand`: run-length expansion with long-tailed lengths, `"3a1c2b>"` -> `"aaacbb"`: the number of runs follows a
  Pareto tail, so most responses are a few characters long and a few are 16x the median or more (the workload
  continuous batching exists for).
* `jsonl`: prompts (and optional solutions) read from a file; the reward must come from the user.

Prompts and responses vary in length (the number of terms / numbers and their digits are drawn per problem), so
rollouts are ragged and balancing them over devices matters.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
from typing import Callable, Iterable

from ..core.jsonl import iter_jsonl

import numpy as np

TASK_NAMES = ("arithmetic", "countdown", "expand", "jsonl")

# Disjoint random streams of one seed: training prompts of step k, the evaluation set, the warm-start data, the
# training pool.
_TRAIN_STREAM, _EVAL_STREAM, _WARMSTART_STREAM, _POOL_STREAM = 1, 2, 3, 5


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt and one correct response (None when the task does not know one)."""

    prompt: str
    solution: str | None


class ArithmeticTask:
    """Multi-digit integer sums and differences: prompt `"<a><op><b>...="`, response the decimal result."""

    name = "arithmetic"
    _PROMPT = re.compile(r"^\d+(?:[+-]\d+)+=$")

    def __init__(self, min_terms: int = 2, max_terms: int = 3, max_digits: int = 2):
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"arithmetic task: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if max_digits < 1:
            raise ValueError(f"arithmetic task: max_digits must be >= 1, got {max_digits}")
        self.min_terms, self.max_terms, self.max_digits = min_terms, max_terms, max_digits

    def problem(self, rng: np.random.Generator) -> Problem:
        """A random problem: the number of terms and each term's digit count are drawn uniformly."""
        terms = int(rng.integers(self.min_terms, self.max_terms + 1))
        numbers = [int(rng.integers(0, 10 ** int(rng.integers(1, self.max_digits + 1)))) for _ in range(terms)]
        operators = ["+" if rng.random() < 0.5 else "-" for _ in range(terms - 1)]
        text = str(numbers[0]) + "".join(op + str(n) for op, n in zip(operators, numbers[1:]))
        prompt = text + "="
        return Problem(prompt, str(self.answer(prompt)))

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt this task makes: every term at max_digits digits, an operator or '=' after each."""
        return self.max_terms * (self.max_digits + 1)

    def answer(self, prompt: str) -> int:
        """The value of the expression in an arithmetic prompt; ValueError if it is not one."""
        if not self._PROMPT.match(prompt):
            raise ValueError(f"not an arithmetic prompt (digits joined by + or -, then '='): {prompt!r}")
        return sum(int(term) for term in re.findall(r"[+-]?\d+", prompt[:-1]))

    def reward(self, prompt: str, response: str) -> float:
        """1.0 when the response (surrounding whitespace ignored) is exactly the decimal answer, else 0.0."""
        return 1.0 if response.strip() == str(self.answer(prompt)) else 0.0


class CountdownTask:
    """Countdown-style puzzles: prompt `"n1 n2 ... >target:"`, response an expression over some of the numbers."""

    name = "countdown"
    _PROMPT = re.compile(r"^(\d+(?: \d+)*)>(-?\d+):$")
    _MAX_RESPONSE_CHARS = 64  # longer responses are not parsed (reward 0): keeps the evaluator cheap

    def __init__(self, min_numbers: int = 2, max_numbers: int = 4, max_number: int = 25):
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"countdown task: need 2 <= min_numbers <= max_numbers, got {min_numbers}, "
                             f"{max_numbers}")
        if max_number < 1:
            raise ValueError(f"countdown task: max_number must be >= 1, got {max_number}")
        self.min_numbers, self.max_numbers, self.max_number = min_numbers, max_numbers, max_number

    def problem(self, rng: np.random.Generator) -> Problem:
        """Random numbers; the target is the value of a random expression over a random ordered subset of them
        (so every puzzle is solvable, and that expression is the warm start's solution). Targets are >= 0."""
        while True:
            count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
            numbers = [int(rng.integers(1, self.max_number + 1)) for _ in range(count)]
            used = int(rng.integers(2, count + 1))
            order = rng.permutation(count)[:used]
            operators = [str(rng.choice(["+", "-", "*"])) for _ in range(used - 1)]
            expression = str(numbers[order[0]]) + "".join(op + str(numbers[i]) for op, i in zip(operators, order[1:]))
            target = _evaluate(expression)[0]
            if target >= 0:
                return Problem(f"{' '.join(map(str, numbers))}>{target}:", expression)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt this task makes: max_numbers numbers and separators, '>', the largest target (the
        product of every number at its largest) and ':'."""
        width = len(str(self.max_number))
        return self.max_numbers * (width + 1) + len(str(self.max_number ** self.max_numbers)) + 1

    def parse_prompt(self, prompt: str) -> tuple[list[int], int]:
        """(numbers, target) of a countdown prompt; ValueError if it is not one."""
        match = self._PROMPT.match(prompt)
        if not match:
            raise ValueError(f"not a countdown prompt ('<numbers separated by spaces>><target>:'): {prompt!r}")
        return [int(n) for n in match.group(1).split()], int(match.group(2))

    def reward(self, prompt: str, response: str) -> float:
        """1.0 when the response is an expression of + - * and parentheses over integer literals, each literal
        one of the prompt's numbers (each used at most as often as it is given), whose value is the target."""
        numbers, target = self.parse_prompt(prompt)
        response = response.strip()
        if not response or len(response) > self._MAX_RESPONSE_CHARS:
            return 0.0
        evaluated = _evaluate(response)
        if evaluated is None:
            return 0.0
        available = list(numbers)
        for value in evaluated[1]:
            if value not in available:
                return 0.0
            available.remove(value)
        return 1.0 if evaluated[0] == target else 0.0


_OPERATORS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


def _evaluate(expression: str) -> tuple[int, list[int]] | None:
    """(value, integer literals left to right) of an expression of integer literals, + - * and parentheses; None
    for anything else."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    literals: list[int] = []

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return node.value
        if not (isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS):
            raise ValueError(node)
        left = value(node.left)  # left before right: the literals come out in reading order
        return _OPERATORS[type(node.op)](left, value(node.right))

    try:
        return value(tree), literals
    except (ValueError, RecursionError):
        return None


class JsonlTask:
    """Prompts read from a JSONL file of `{"prompt": str, "solution": str (optional)}` records; it has no reward
    of its own (give the run a reward function)."""

    name = "jsonl"

    def __init__(self, path: str):
        self.path = path
        self.problems = read_prompts(path)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt of the file."""
        return max(len(p.prompt) for p in self.problems)

    def problem(self, rng: np.random.Generator) -> Problem:
        """A record drawn uniformly."""
        return self.problems[int(rng.integers(len(self.problems)))]

    def reward(self, prompt: str, response: str) -> float:
        raise ValueError(f"the jsonl task ({self.path}) has no built-in reward: set task.reward_fn (or pass "
                         "reward_fn= to run_rl)")


class ExpandTask:
    """Run-length expansion: prompt `"<count><letter>...>"`, response each letter repeated count times, in order.

    The number of runs is drawn from a discrete Pareto tail, `min(max_runs, floor(min_runs * u ** (-1 / tail)))`
    for u uniform in (0, 1]: with the defaults (1..32 runs, tail 1.2, counts 1..9) the median response is about 8
    characters and about 2% of responses are 16x that or longer. Each run's letter differs from the previous
    one's, so the response determines the runs and the prompt is the unique correct encoding of it."""

    name = "expand"
    _PROMPT = re.compile(r"^(?:[1-9][a-z])+>$")

    def __init__(self, min_runs: int = 1, max_runs: int = 32, max_count: int = 9, letters: int = 5,
                 tail: float = 1.2):
        if not 1 <= min_runs <= max_runs:
            raise ValueError(f"expand task: need 1 <= min_runs <= max_runs, got {min_runs}, {max_runs}")
        if not 1 <= max_count <= 9:
            raise ValueError(f"expand task: max_count must be in 1..9 (one digit), got {max_count}")
        if not 2 <= letters <= 26:
            raise ValueError(f"expand task: letters must be in 2..26, got {letters}")
        if not tail > 0:
            raise ValueError(f"expand task: tail must be > 0, got {tail}")
        self.min_runs, self.max_runs, self.max_count, self.letters, self.tail = (min_runs, max_runs, max_count,
                                                                                 letters, float(tail))

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt this task makes: max_runs runs of a digit and a letter, then '>'."""
        return 2 * self.max_runs + 1

    def runs(self, rng: np.random.Generator) -> int:
        """A number of runs from the Pareto tail (see the class docstring)."""
        u = 1.0 - float(rng.random())  # in (0, 1]
        return int(min(self.max_runs, np.floor(self.min_runs * u ** (-1.0 / self.tail))))

    def problem(self, rng: np.random.Generator) -> Problem:
        """A random problem: a Pareto number of runs, each a count in 1..max_count and a letter unlike the last."""
        parts, previous = [], -1
        for _ in range(self.runs(rng)):
            if previous < 0:
                letter = int(rng.integers(0, self.letters))
            else:  # any letter but the previous run's
                letter = int(rng.integers(0, self.letters - 1))
                letter += letter >= previous
            parts.append((int(rng.integers(1, self.max_count + 1)), chr(ord("a") + letter)))
            previous = letter
        prompt = "".join(f"{n}{c}" for n, c in parts) + ">"
        return Problem(prompt, self.expansion(prompt))

    def expansion(self, prompt: str) -> str:
        """The expansion of an expand prompt; ValueError if it is not one."""
        if not self._PROMPT.match(prompt):
            raise ValueError(f"not an expand prompt (runs of a digit 1-9 and a letter a-z, then '>'): {prompt!r}")
        return "".join(c * int(n) for n, c in re.findall(r"([1-9])([a-z])", prompt))

    def reward(self, prompt: str, response: str) -> float:
        """1.0 when the response (surrounding whitespace ignored) is exactly the expansion, else 0.0."""
        return 1.0 if response.strip() == self.expansion(prompt) else 0.0


def fingerprint_task(task) -> dict | None:
    """{"examples": count, "sha256": ...} of the prompts (and solutions) a task reads from a file, which a checkpoint
    records so that a resume on a file edited in place is noticed; None for generated tasks (their problems follow
    from the config and the seed, which a checkpoint already pins)."""
    problems = getattr(task, "problems", None)
    if problems is None:
        return None
    digest = hashlib.sha256()
    for p in problems:
        digest.update(json.dumps([p.prompt, p.solution]).encode("utf-8") + b"\n")
    return {"examples": len(problems), "sha256": digest.hexdigest()}


def read_prompts(path: str) -> list[Problem]:
    """The problems of a JSONL prompt file; ValueError naming `path:line` for a malformed record."""
    problems = []
    try:
        for where, record in iter_jsonl(path, missing_hint='a .jsonl file of {"prompt": ...} records'):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise ValueError(f"{where}: a record needs a non-empty string 'prompt'")
            solution = record.get("solution")
            if solution is not None and not isinstance(solution, str):
                raise ValueError(f"{where}: 'solution' must be a string when present")
            problems.append(Problem(record["prompt"], solution))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"task.path {e}") from None
    if not problems:
        raise ValueError(f"{path}: no prompts")
    return problems


Task = ArithmeticTask | CountdownTask | ExpandTask | JsonlTask


def make_task(name: str, **options) -> Task:
    """The task called `name` with its options (arithmetic: min_terms, max_terms, max_digits; countdown:
    min_numbers, max_numbers, max_number; expand: min_runs, max_runs, max_count, letters, tail; jsonl: path)."""
    factories: dict[str, Callable[..., Task]] = {"arithmetic": ArithmeticTask, "countdown": CountdownTask,
                                                 "expand": ExpandTask, "jsonl": JsonlTask}
    if name not in factories:
        raise ValueError(f"unknown task {name!r}; tasks are {', '.join(TASK_NAMES)}")
    return factories[name](**options)


def _problems(task: Task, rng: np.random.Generator, count: int) -> list[Problem]:
    return [task.problem(rng) for _ in range(count)]


def training_pool(task: Task, seed: int, size: int) -> list[Problem]:
    """A fixed training set of `size` problems (an RL prompt dataset, trained on for many epochs)."""
    if size < 1:
        raise ValueError(f"a training pool needs at least one problem, got {size}")
    return _problems(task, np.random.default_rng([seed, _POOL_STREAM]), size)


def step_problems(task: Task, seed: int, step: int, count: int, pool: list[Problem] | None = None, *,
                  held_out: Iterable[str] = ()) -> list[Problem]:
    """The `count` training prompts of 0-based step `step`: a pure function of (seed, step), so a resumed run
    sees the same prompts. Without a pool every step draws fresh problems, skipping the prompts in `held_out` (the
    evaluation set's: on a small problem space fresh draws would otherwise train on the evaluation problems
    themselves); with one, the step draws `count` of its problems (distinct ones while the pool is large enough,
    else with repetition) and `held_out` is not consulted (the evaluation set is drawn outside the pool)."""
    rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
    if pool is not None:
        picks = rng.choice(len(pool), size=count, replace=count > len(pool))
        return [pool[int(i)] for i in picks]
    held_out = set(held_out)
    if not held_out:
        return _problems(task, rng, count)
    out: list[Problem] = []
    for _ in range(_EVAL_DRAWS_PER_PROBLEM * count):
        problem = task.problem(rng)
        if problem.prompt not in held_out:
            out.append(problem)
            if len(out) == count:
                return out
    raise ValueError(f"the {task.name} task drew fewer than {count} training problems outside the {len(held_out)} "
                     f"held-out evaluation problems in {_EVAL_DRAWS_PER_PROBLEM * count} draws; lower "
                     "task.eval_problems or widen the task")


#: How many draws per requested evaluation problem `eval_problems` may make before it gives up.
_EVAL_DRAWS_PER_PROBLEM = 100


def eval_problems(task: Task, seed: int, count: int, *, exclude: Iterable[Problem] = ()) -> list[Problem]:
    """The run's fixed evaluation prompts: up to `count` distinct problems, none of them in `exclude` (pass the
    training pool, so that evaluation is held out), drawn from the evaluation stream skipping repeats and excluded
    prompts. A task with fewer such problems (a small prompt file, a tiny problem space) gives all it has, found
    within `_EVAL_DRAWS_PER_PROBLEM * count` draws; ValueError when it has none."""
    rng = np.random.default_rng([seed, _EVAL_STREAM])
    taken = {p.prompt for p in exclude}
    out: list[Problem] = []
    for _ in range(_EVAL_DRAWS_PER_PROBLEM * count):
        problem = task.problem(rng)
        if problem.prompt not in taken:
            taken.add(problem.prompt)
            out.append(problem)
            if len(out) == count:
                break
    if not out:
        raise ValueError(f"the {task.name} task has no evaluation problem outside the training pool of "
                         f"{len(taken)} problems; lower task.pool_size or widen the task")
    return out


def warmstart_records(task: Task, seed: int, count: int) -> list[dict]:
    """`count` prompt/completion records of correct solutions, for the SFT warm start."""
    records = []
    for p in _problems(task, np.random.default_rng([seed, _WARMSTART_STREAM]), count):
        if p.solution is None:
            raise ValueError(f"the {task.name} task has a prompt without a solution ({p.prompt!r}); the warm start "
                             "needs one per prompt (set warmstart.steps: 0, or add 'solution' to every record)")
        records.append({"prompt": p.prompt, "completion": p.solution})
    return records

