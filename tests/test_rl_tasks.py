"""RL tasks and the reward interface: generated problems are solvable and scored by exact match, prompts are a
pure function of (seed, step), user reward functions load from a module or a file, and a reward function that
raises or returns a non-number is reported with the sample it failed on."""
import json
import math

import numpy as np
import pytest

from jodc.train.rl.rewards import RewardError, load_reward_function, score
from jodc.train.rl.tasks import (
    ArithmeticTask,
    CountdownTask,
    ExpandTask,
    JsonlTask,
    eval_problems,
    make_task,
    read_prompts,
    step_problems,
    training_pool,
    warmstart_records,
)


def test_expand_problems_are_solved_by_their_solution_and_their_lengths_have_a_long_tail():
    """Most expand responses are a few characters and about 2% are 16x the median or longer (the workload of
    continuous batching); each prompt is the unique run-length encoding of its solution."""
    task = make_task("expand")
    rng = np.random.default_rng(0)
    problems = [task.problem(rng) for _ in range(4000)]
    lengths = np.array([len(p.solution) for p in problems])
    median = np.median(lengths)
    assert 4 <= median <= 12 and 0.01 <= np.mean(lengths >= 16 * median) <= 0.05
    assert lengths.max() <= 32 * 9 and lengths.min() >= 1
    for p in problems[:300]:
        assert p.prompt.endswith(">") and task.reward(p.prompt, p.solution) == 1.0
        assert task.reward(p.prompt, f" {p.solution}\n") == 1.0
        assert task.reward(p.prompt, p.solution + p.solution[-1]) == 0.0 and task.reward(p.prompt, p.solution[:-1]) == 0.0
        letters = p.prompt[1:-1:2]
        assert all(a != b for a, b in zip(letters, letters[1:]))  # a run's letter differs from the previous run's
    assert task.reward("3a1c2b>", "aaacbb") == 1.0 and task.reward("3a1c2b>", "aaacb") == 0.0
    short = ExpandTask(min_runs=2, max_runs=2, max_count=1, letters=2)
    assert {short.problem(rng).solution for _ in range(50)} == {"ab", "ba"}
    with pytest.raises(ValueError, match="not an expand prompt"):
        task.reward("0a>", "")
    for bad in ({"min_runs": 0}, {"min_runs": 3, "max_runs": 2}, {"max_count": 10}, {"letters": 1}, {"tail": 0}):
        with pytest.raises(ValueError, match="expand task"):
            ExpandTask(**bad)


def test_arithmetic_problems_are_solved_by_their_solution_and_vary_in_length():
    task = ArithmeticTask(min_terms=2, max_terms=4, max_digits=3)
    rng = np.random.default_rng(0)
    problems = [task.problem(rng) for _ in range(300)]
    for p in problems:
        assert p.prompt.endswith("=")
        assert eval(p.prompt[:-1]) == int(p.solution)  # the prompt is a Python expression of + and -
        assert task.reward(p.prompt, p.solution) == 1.0
        assert task.reward(p.prompt, f"  {p.solution}\n") == 1.0  # surrounding whitespace is ignored
        assert task.reward(p.prompt, str(int(p.solution) + 1)) == 0.0
        assert task.reward(p.prompt, p.solution + "0") == 0.0
    assert task.reward("12-30=", "-18") == 1.0 and task.reward("12-30=", "18") == 0.0
    lengths = {len(p.prompt) for p in problems}
    assert min(lengths) <= 5 and max(lengths) >= 14  # 2 one-digit terms .. 4 three-digit terms
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        task.reward("what is 2+2?", "4")


def test_countdown_rewards_valid_expressions_over_the_given_numbers_only():
    task = CountdownTask()
    assert task.parse_prompt("3 7 25>46:") == ([3, 7, 25], 46)
    good = ["25+3*7", "(25+3*7)", "7*3+25", " 3 * 7 + 25 ", "(3*(7))+25"]
    for response in good:
        assert task.reward("3 7 25>46:", response) == 1.0, response
    bad = ["25+21",            # 21 is not given
           "25+3*7+0",         # 0 is not given
           "3*3",              # 3 given once, used twice (target 9 below)
           "25+3*7-1+1",       # literals not given
           "46", "", "25+3*7=46", "2**5", "25/5", "-3+49",
           "__import__('os').getcwd()", "(" * 40 + "1" + ")" * 40]
    for response in bad:
        assert task.reward("3 7 25>46:", response) == 0.0, response
    assert task.reward("3 3>9:", "3*3") == 1.0  # a number given twice may be used twice
    assert task.reward("3>9:", "3*3") == 0.0
    rng = np.random.default_rng(1)
    for _ in range(200):
        p = task.problem(rng)
        assert task.reward(p.prompt, p.solution) == 1.0, p
        assert task.parse_prompt(p.prompt)[1] >= 0
    with pytest.raises(ValueError, match="not a countdown prompt"):
        task.reward("1+2=", "3")


def test_prompt_streams_are_pure_functions_of_seed_and_step():
    task = make_task("arithmetic", max_digits=3)
    a = step_problems(task, seed=5, step=3, count=8)
    assert a == step_problems(task, seed=5, step=3, count=8)
    assert a != step_problems(task, seed=5, step=4, count=8)
    assert a != step_problems(task, seed=6, step=3, count=8)
    assert eval_problems(task, 5, 16) == eval_problems(task, 5, 16) != a[:16]
    records = warmstart_records(task, 5, 10)
    assert all(task.reward(r["prompt"], r["completion"]) == 1.0 for r in records)
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        make_task("poetry")
    with pytest.raises(ValueError, match="min_terms <= max_terms"):
        make_task("arithmetic", min_terms=4, max_terms=3)


def test_fresh_training_problems_skip_the_held_out_evaluation_prompts():
    """On a small problem space (single-digit sums of 2 terms: 200 problems) fresh draws would train on the
    evaluation problems themselves; with `held_out` they never do, and stay a pure function of (seed, step)."""
    task = make_task("arithmetic", max_digits=1, min_terms=2, max_terms=2)
    evaluation = {p.prompt for p in eval_problems(task, 3, 150)}
    plain = [p.prompt for s in range(20) for p in step_problems(task, seed=3, step=s, count=16)]
    assert evaluation & set(plain)  # the regression: without held_out, evaluation prompts are trained on
    drawn = [step_problems(task, seed=3, step=s, count=16, held_out=evaluation) for s in range(20)]
    assert not evaluation & {p.prompt for step in drawn for p in step}
    assert all(len(step) == 16 for step in drawn)
    assert drawn[0] == step_problems(task, seed=3, step=0, count=16, held_out=evaluation)
    everything = {p.prompt for p in eval_problems(task, 3, 1000)}  # all 200 problems
    with pytest.raises(ValueError, match="outside the 200 held-out evaluation problems"):
        step_problems(task, seed=3, step=0, count=4, held_out=everything)


def test_a_training_pool_is_a_fixed_problem_set_that_steps_draw_from():
    task = make_task("arithmetic")
    pool = training_pool(task, seed=1, size=10)
    assert pool == training_pool(task, seed=1, size=10) and len(set(pool)) == 10
    drawn = step_problems(task, seed=1, step=0, count=8, pool=pool)
    assert len(set(drawn)) == 8 and set(drawn) <= set(pool)  # distinct while the pool is large enough
    assert drawn == step_problems(task, seed=1, step=0, count=8, pool=pool)
    assert drawn != step_problems(task, seed=1, step=1, count=8, pool=pool)
    assert set(step_problems(task, seed=1, step=2, count=25, pool=pool)) <= set(pool)  # with repetition
    with pytest.raises(ValueError, match="at least one problem"):
        training_pool(task, seed=1, size=0)


def test_jsonl_prompts_need_a_user_reward_and_solutions_for_the_warm_start(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "say hi", "solution": "hi"}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    task = JsonlTask(str(path))
    assert [p.prompt for p in task.problems] == ["say hi", "x"]
    assert task.problem(np.random.default_rng(0)).prompt in ("say hi", "x")
    with pytest.raises(ValueError, match="no built-in reward"):
        task.reward("x", "y")
    with pytest.raises(ValueError, match="needs one per prompt"):
        warmstart_records(task, 0, 20)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: a record needs a non-empty string 'prompt'"):
        read_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xff at column 13\)"):
        read_prompts(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "a\\ud83d"}\n')
    with pytest.raises(ValueError, match=r"surrogate.jsonl:1: 'prompt' at character 1 .* lone UTF-16 surrogate"):
        read_prompts(str(tmp_path / "surrogate.jsonl"))


def test_reward_functions_load_from_a_module_or_a_file(tmp_path):
    assert load_reward_function("math:hypot") is math.hypot
    file = tmp_path / "my_reward.py"
    file.write_text("def length_reward(prompt, response):\n    return len(response) / 10\n")
    fn = load_reward_function(f"{file}:length_reward")
    assert fn("p", "abcde") == 0.5
    for spec, error, message in [("nocolon", ValueError, "must look like"),
                                 ("no_such_module_xyz:f", ImportError, "cannot import module"),
                                 (f"{file}:missing", AttributeError, "has no attribute 'missing'"),
                                 ("math:pi", TypeError, "not a function"),
                                 (f"{tmp_path}/absent.py:f", FileNotFoundError, "does not exist")]:
        with pytest.raises(error, match=message):
            load_reward_function(spec)


def test_score_accepts_real_numbers_and_names_the_failing_sample():
    prompts, responses = ["a", "b", "c"], ["1", "2", "3"]
    np.testing.assert_array_equal(score(lambda p, r: int(r), prompts, responses, step=1), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(score(lambda p, r: r == "2", prompts, responses, step=1), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(score(lambda p, r: np.float32(0.5), prompts, responses, step=1), [0.5] * 3)

    def raising(prompt, response):
        if response == "2":
            raise KeyError("boom")
        return 0.0

    with pytest.raises(RewardError, match=r"raised KeyError on step 7, sample 1 \(prompt 'b', response '2'\)") as e:
        score(raising, prompts, responses, step=7)
    assert (e.value.step, e.value.sample, e.value.prompt, e.value.response) == (7, 1, "b", "2")
    assert isinstance(e.value.__cause__, KeyError)
    for value, shown in [(None, "None"), ("1.0", "'1.0'"), (float("nan"), "nan"), (np.ones(2), "array")]:
        with pytest.raises(RewardError, match=f"returned {shown}.*step 3, sample 0 .*finite real number"):
            score(lambda p, r, v=value: v, prompts, responses, step=3)
    with pytest.raises(ValueError, match="3 prompts but 2 responses"):
        score(lambda p, r: 0.0, prompts, responses[:2], step=1)


def test_evaluation_problems_are_distinct_and_held_out_from_the_training_pool():
    # bench/rl.py's setting: before the fix 76 of the 256 evaluation problems (55 distinct) were in the pool and
    # only 223 were distinct
    task = make_task("arithmetic", max_digits=1, max_terms=3)
    pool = training_pool(task, seed=0, size=256)
    held_out = eval_problems(task, 0, 256, exclude=pool)
    assert len({p.prompt for p in held_out}) == 256
    assert not {p.prompt for p in held_out} & {p.prompt for p in pool}
    assert held_out == eval_problems(task, 0, 256, exclude=pool)  # still a pure function of the seed
    assert len(set(eval_problems(task, 0, 256))) == 256  # distinct without a pool too
    small = make_task("arithmetic", max_digits=1, min_terms=2, max_terms=2)  # at most 2 * 10 * 10 problems
    everything = eval_problems(small, 0, 300)  # fewer than asked: every distinct problem, once
    assert 100 < len(everything) == len({p.prompt for p in everything}) < 300
    assert len(eval_problems(small, 0, 300, exclude=everything[:50])) == len(everything) - 50
    with pytest.raises(ValueError, match="no evaluation problem outside the training pool"):
        eval_problems(small, 0, 10, exclude=everything)
