"""jodc.train data: the byte-level tokenizer, JSONL records (both shapes, loss masks, malformed lines), the length
policy, the embedded dataset, and the deterministic minibatch sampler."""
import json

import numpy as np
import pytest

from jodc.train.sft import data as D
from jodc.train.sft import embedded
from jodc.train.sft.sampler import MinibatchSampler
from jodc.models.tokenizer import (BOS, EOS, PAD, ROLE_TOKENS, byte_level_tokenizer, load_tokenizer,
                                  model_vocab_size, save_tokenizer)

TOK = byte_level_tokenizer()


def write_jsonl(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_byte_level_tokenizer_is_one_id_per_byte_and_round_trips(tmp_path):
    text = "héllo, wörld!\n\t~"
    ids = TOK.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (256, 257, 258)
    assert TOK.encode(ROLE_TOKENS["user"], add_special_tokens=False) == [TOK.token_to_id(ROLE_TOKENS["user"])]
    assert model_vocab_size(TOK) == 264 and TOK.vocab_size == 263
    save_tokenizer(TOK, str(tmp_path / "tok"))
    again = load_tokenizer(str(tmp_path / "tok"))  # a HF-style directory
    assert again.encode(text, add_special_tokens=False) == ids and again.eos_token_id == TOK.eos_token_id
    bare = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))  # a bare file: built-in special names found
    assert (bare.bos_token_id, bare.pad_token_id) == (TOK.bos_token_id, TOK.token_to_id(PAD))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "absent.json"))


def test_prompt_completion_masks_only_the_completion_and_eos():
    tokens, mask = D.encode_prompt_completion(TOK, "ab", "xyz")
    assert tokens.tolist() == [TOK.bos_token_id, ord("a"), ord("b"), ord("x"), ord("y"), ord("z"), TOK.eos_token_id]
    assert mask.tolist() == [False, False, False, True, True, True, True]


def test_messages_mask_only_assistant_contents():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    tokens, mask = D.encode_messages(TOK, messages)
    trained = TOK.decode(tokens[mask].tolist(), skip_special_tokens=False)
    assert trained == f"yo{EOS}a{EOS}"
    assert tokens[0] == TOK.bos_token_id and TOK.decode(tokens.tolist(), skip_special_tokens=False).startswith(
        f"{BOS}{ROLE_TOKENS['system']}\ns{EOS}{ROLE_TOKENS['user']}\nhi")


def test_load_jsonl_reads_both_shapes_and_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "p", "completion": "c"}, "",
                                  {"messages": [{"role": "user", "content": "u"},
                                                {"role": "assistant", "content": "a"}]}])
    examples, report = D.load_jsonl(path, TOK, max_length=64)
    assert len(examples) == 2 and report.kept == 2
    assert examples[0].num_loss_tokens == 2 and examples[1].num_loss_tokens == 2  # content + eos


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"text": "x"}, "needs 'prompt' and 'completion', or 'messages'"),
    ({"prompt": "p"}, "'completion' must be a string, got NoneType"),
    ({"prompt": 3, "completion": "c"}, "'prompt' must be a string, got int"),
    ({"prompt": "p", "completion": ""}, "empty completion"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] must be an object with 'role' and 'content'"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\] has role 'bot'"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content must be a string"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
])
def test_malformed_records_name_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path, [{"prompt": "p", "completion": "c"}, "", bad])
    with pytest.raises(D.RecordError, match=f"d.jsonl:3: .*{message}"):
        D.load_jsonl(path, TOK, max_length=64)


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "caf\xe9", "completion": "c"}', r"d.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"),
    (b'{"prompt": "a\\ud800b", "completion": "c"}', r"d.jsonl:2: 'prompt' at character 1 .* lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "assistant", "content": "x\\udfff"}]}',
     r"d.jsonl:2: 'messages'\[0\]\.content at character 1 .* lone UTF-16 surrogate"),
])
def test_text_that_is_not_unicode_names_file_line_and_place(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "p", "completion": "c"}\n' + line + b"\n")
    with pytest.raises(D.RecordError, match=message):
        D.load_jsonl(str(path), TOK, max_length=64)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file .* does not exist"):
        D.load_jsonl(str(tmp_path / "nope.jsonl"), TOK, max_length=64)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(D.RecordError, match="empty.jsonl: no records"):
        D.load_jsonl(str(tmp_path / "empty.jsonl"), TOK, max_length=64)


def test_overlong_sequences_are_truncated_or_dropped_and_reported(tmp_path):
    records = [{"prompt": "p" * 5, "completion": "c" * 5},     # 12 tokens: fits in 12
               {"prompt": "p" * 5, "completion": "c" * 20},    # 27 tokens: truncated keeps 6 completion tokens
               {"prompt": "p" * 30, "completion": "c"}]        # 33 tokens: truncation leaves no completion
    kept, report = D.load_records(records, TOK, max_length=12, overlong="truncate", source="s")
    assert [e.length for e in kept] == [12, 12] and kept[1].num_loss_tokens == 6
    assert (report.kept, report.truncated, report.dropped_no_loss_tokens) == (2, 2, 1)
    assert "2 truncated to max_length" in report.summary() and "1 dropped with no completion" in report.summary()
    kept, report = D.load_records(records, TOK, max_length=12, overlong="drop", source="s")
    assert [e.length for e in kept] == [12] and report.dropped_overlong == 2
    with pytest.raises(ValueError, match="no usable example"):
        D.load_records(records[2:], TOK, max_length=12, overlong="drop", source="s")


def test_loader_counts_the_sequences_for_context_parallel_groups():
    records = [{"prompt": "p" * 5, "completion": "c" * 5},     # 12 tokens: within the cap of 12
               {"prompt": "p" * 5, "completion": "c" * 20}]    # 27 tokens: longer than the cap, within max_length
    kept, report = D.load_records(records, TOK, max_length=32, overlong="truncate", source="s", token_cap=12)
    assert [e.length for e in kept] == [12, 27] and (report.truncated, report.context_parallel) == (0, 1)
    assert "1 longer than engine.token_cap, split over context-parallel groups" in report.summary()


def test_example_rejects_a_trained_first_token():
    with pytest.raises(ValueError, match="first token"):
        D.Example(np.array([1, 2], np.int32), np.array([True, False]))


def test_embedded_dataset_is_seeded_learnable_and_long_tailed():
    records = embedded.generate_records(2000, seed=0)
    assert embedded.generate_records(300, seed=0) == embedded.generate_records(300, seed=0)
    assert embedded.generate_records(300, seed=0) != embedded.generate_records(300, seed=1)
    for r in records[:50]:  # the completion is the task applied to the prompt's words
        task, words = r["prompt"].rstrip("\n").split(": ", 1)
        assert r["completion"] == embedded.solve(task, words.split(" "))
    examples, report = D.load_records(records, TOK, max_length=2048, overlong="truncate", source="embedded")
    lengths = np.array([e.length for e in examples])
    assert report.kept == 2000 and lengths.min() >= 16 and lengths.max() <= 2048
    assert 0.75 < np.mean((lengths >= 32) & (lengths <= 200)) < 0.95  # most are short ...
    assert lengths.max() > 600 and np.mean(lengths > 400) > 0.01      # ... with a long tail
    assert embedded.solve("sort", ["b", "a"]) == "a b" and embedded.solve("upper", ["ab"]) == "AB"
    with pytest.raises(ValueError, match="unknown task"):
        embedded.solve("shuffle", ["a"])


def test_sampler_is_a_pure_function_of_seed_and_step():
    s = MinibatchSampler(10, 4, seed=3)
    first = [s.minibatch(k).tolist() for k in range(5)]
    assert first == [MinibatchSampler(10, 4, seed=3).minibatch(k).tolist() for k in range(5)]
    assert MinibatchSampler(10, 4, seed=3).minibatch(3).tolist() == first[3]  # random access, no state
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # epochs are permutations
    assert first != [MinibatchSampler(10, 4, seed=4).minibatch(k).tolist() for k in range(5)]
    state = s.state_dict(7)
    assert s.check_state(state) == 7
    with pytest.raises(ValueError, match="num_examples=10, this run has 11"):
        MinibatchSampler(11, 4, seed=3).check_state(state)
    with pytest.raises(ValueError, match="at least one example"):
        MinibatchSampler(0, 4)
