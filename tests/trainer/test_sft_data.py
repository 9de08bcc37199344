"""trainer.data.sft: jsonl formats, ChatML loss masks, packing invariants and resumable batches.

The tokenizer is a tiny byte-level BPE trained here with `tokenizers`, so nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data.sft import (
    ChatMLTemplate,
    Conversation,
    PackedRow,
    SFTBatches,
    SFTDataError,
    TokenizedSample,
    TokenizerChatTemplate,
    chat_template,
    collate,
    fit_to_length,
    load_tokenizer,
    pack_row,
    plan_rows,
    read_conversations,
    tokenize_conversation,
    tokenize_conversations,
    unpack_row,
)
from trainer.tokenizer import TokenizerError

CORPUS = [
    "You are a helpful robot. Pick up the red block and place it in the bin.",
    "What is the capital of France? The capital of France is Paris.",
    "Translate to French: good morning. Bonjour!",
    "Write a haiku about gradient descent.\nLoss falls like rain\non the valley floor.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols {}[]()<>:;,.!? déjà vu",
]

CHATML_JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(directory: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"), ["<pad>", "<|im_start|>", "<|im_end|>"])


@pytest.fixture(scope="module")
def template(tokenizer_dir: Path) -> ChatMLTemplate:
    return ChatMLTemplate(load_tokenizer(tokenizer_dir))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation(tuple(turns), "test")


MULTI_TURN = conv(("system", "You are a helpful robot."),
                  ("user", "Pick up the red block."),
                  ("assistant", "Done: the red block is in the bin."),
                  ("user", "What is the capital of France?"),
                  ("assistant", "The capital of France is Paris!"),
                  ("user", "Write a haiku."))


# --- readers ---------------------------------------------------------------------------------


def test_formats_parse_to_the_same_turns(tmp_path: Path):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [
        {"system": "Be brief.", "instruction": "Translate to French:", "input": "good morning", "output": "Bonjour!",
         "id": 7},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ])
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."},
                           {"from": "human", "value": "Translate to French:\n\ngood morning"},
                           {"from": "gpt", "value": "Bonjour!"}]},
        "",  # blank lines are skipped
        {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]},
    ])
    messages = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Translate to French:\n\ngood morning"},
                      {"role": "assistant", "content": "Bonjour!"}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
    ])
    parsed = [[c.turns for c in read_conversations(p)] for p in (alpaca, sharegpt, messages)]
    assert parsed[0] == parsed[1] == parsed[2] == [
        (("system", "Be brief."), ("user", "Translate to French:\n\ngood morning"), ("assistant", "Bonjour!")),
        (("user", "Say hi."), ("assistant", "hi")),
    ]
    assert read_conversations(sharegpt)[1].origin == f"{sharegpt}:3"
    assert [c.turns for c in read_conversations(messages, format="messages")] == parsed[2]


def test_a_conversation_may_end_on_a_user_turn(tmp_path: Path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"},
                                                            {"role": "user", "content": "c"}]}])
    assert read_conversations(path)[0].turns[-1] == ("user", "c")


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize(("bad", "problem"), [
    ('{"messages": [', "not valid JSON"),
    ('["messages"]', "expected a JSON object"),
    ({"conversations": []}, "missing 'messages'"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": "hello"}, "'messages' must be a list"),
    ({"messages": ["hello"]}, "messages[0]: expected a JSON object"),
    ({"messages": [{"role": "user"}]}, "messages[0]: missing 'content'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0]: 'content' must be a str"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}]},
     "messages[1]: unknown role 'tool'"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, "no assistant turn"),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, bad, problem: str):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(SFTDataError) as e:
        read_conversations(path)
    assert f"{path}:3: " in str(e.value)
    assert problem in str(e.value)


@pytest.mark.parametrize(("fmt", "bad", "problem"), [
    ("alpaca", {"instruction": "q"}, "missing 'output'"),
    ("alpaca", {"instruction": "q", "input": None, "output": "a"}, "'input' must be a str"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
     "unknown from 'bot'; expected one of system, human, gpt"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
])
def test_malformed_lines_in_other_formats(tmp_path: Path, fmt: str, bad, problem: str):
    path = write_jsonl(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(SFTDataError, match=f"bad.jsonl:1: .*{problem}".replace("[", r"\[").replace("(", r"\(")):
        read_conversations(path, format=fmt)


def test_undetectable_format_names_the_line_and_the_fix(tmp_path: Path):
    path = write_jsonl(tmp_path / "x.jsonl", ["", {"prompt": "q", "completion": "a"}])
    with pytest.raises(SFTDataError, match=r"x.jsonl:2: cannot tell the format.*pass format="):
        read_conversations(path)


# --- templates and loss masks ----------------------------------------------------------------


def test_loss_mask_is_exactly_the_assistant_tokens(template: ChatMLTemplate):
    sample = tokenize_conversation(MULTI_TURN, template)
    tok = template.tokenizer
    rendered = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in MULTI_TURN.turns)
    assert decode(tok, sample.token_ids) == rendered
    spans = [decode(tok, sample.token_ids[a:b]) for a, b in runs(sample.assistant_mask)]
    assert spans == [f"{c}<|im_end|>" for r, c in MULTI_TURN.turns if r == "assistant"]
    # the prompt up to an assistant turn tokenises exactly as it would alone at inference
    first = runs(sample.assistant_mask)[0][0]
    prompt = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in MULTI_TURN.turns[:2]) + "<|im_start|>assistant\n"
    assert sample.token_ids[:first].tolist() == tok.encode(prompt, add_special_tokens=False)


def test_labels_are_the_next_token_and_the_loss_trains_assistant_tokens(template: ChatMLTemplate):
    sample = tokenize_conversation(MULTI_TURN, template)
    n = len(sample.token_ids)
    row = pack_row([sample], seq_len=n + 5, pad_id=0)
    assert row.tokens[: n - 1].tolist() == sample.token_ids[:-1].tolist()
    assert row.labels[: n - 1].tolist() == sample.token_ids[1:].tolist()
    assert row.loss_mask[: n - 1].tolist() == sample.assistant_mask[1:].astype(np.float32).tolist()
    trained = [decode(template.tokenizer, row.labels[a:b]) for a, b in runs(row.loss_mask > 0)]
    assert trained == ["Done: the red block is in the bin.<|im_end|>", "The capital of France is Paris!<|im_end|>"]
    assert (row.loss_mask[n - 1:] == 0).all() and (row.labels[n - 1:] == 0).all()


def test_the_tokenizer_chat_template_gives_the_same_tokens_and_mask(tokenizer_dir: Path, template: ChatMLTemplate):
    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = CHATML_JINJA
    theirs = tokenize_conversation(MULTI_TURN, chat_template(tok, "tokenizer"))
    ours = tokenize_conversation(MULTI_TURN, template)
    assert theirs.token_ids.tolist() == ours.token_ids.tolist()
    assert theirs.assistant_mask.tolist() == ours.assistant_mask.tolist()


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer_dir: Path):
    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = "{{ messages | length }}:" + CHATML_JINJA  # the prefix changes with every turn
    with pytest.raises(SFTDataError, match="use template='chatml'"):
        tokenize_conversation(MULTI_TURN, TokenizerChatTemplate(tok))


def test_missing_template_tokens_are_reported(tmp_path: Path, tokenizer_dir: Path):
    plain = load_tokenizer(train_tokenizer(tmp_path, ["<pad>"]))
    with pytest.raises(SFTDataError, match=r"no single token for '<\|im_start\|>'.*add_special_tokens"):
        chat_template(plain)
    with pytest.raises(SFTDataError, match="has no chat_template"):
        chat_template(load_tokenizer(tokenizer_dir), "tokenizer")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


def test_truncation_policy(template: ChatMLTemplate, caplog: pytest.LogCaptureFixture):
    sample = tokenize_conversation(MULTI_TURN, template)
    n = len(sample.token_ids)
    assert fit_to_length(sample, seq_len=n - 1) is sample  # n tokens fill n - 1 positions exactly
    cut = fit_to_length(sample, seq_len=n - 4)
    assert cut.token_ids.tolist() == sample.token_ids[: n - 3].tolist()
    assert cut.assistant_mask.tolist() == sample.assistant_mask[: n - 3].tolist()
    assert fit_to_length(sample, seq_len=n - 4, truncation="drop") is None
    first_trained = int(np.argmax(sample.assistant_mask))
    assert fit_to_length(sample, seq_len=first_trained - 1) is None  # nothing left to train on
    assert fit_to_length(sample, seq_len=first_trained) is not None
    with caplog.at_level(logging.WARNING):
        kept = tokenize_conversations([MULTI_TURN, conv(("user", "hi"), ("assistant", "hi"))], template,
                                      seq_len=first_trained - 1)
    assert len(kept) == 1 and "1 of 2 conversations skipped" in caplog.text
    with pytest.raises(SFTDataError, match="none of 1 conversations"):
        tokenize_conversations([MULTI_TURN], template, seq_len=2)


# --- packing ---------------------------------------------------------------------------------


def synthetic_samples(lengths: list[int], seed: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    return [TokenizedSample(rng.integers(1, 1000, n), rng.random(n) < 0.5, f"s{i}") for i, n in enumerate(lengths)]


def check_rows(samples: list[TokenizedSample], plan: list[list[int]], rows: list[PackedRow], seq_len: int):
    """Every invariant of packed rows, against the samples they were packed from."""
    assert sorted(i for row in plan for i in row) == list(range(len(samples)))  # each sample exactly once
    fills = [sum(samples[i].positions for i in row) for row in plan]
    assert all(0 < f <= seq_len for f in fills)
    # best fit never opens a row that an earlier row had room for, so no two rows could merge
    assert all(a + b > seq_len for k, a in enumerate(fills) for b in fills[k + 1:])
    batch = collate(rows)  # the attention mask as training gets it
    for r, (row, members) in enumerate(zip(rows, plan, strict=True)):
        seg = row.segment_ids
        pad = seg < 0
        assert pad.sum() == seq_len - fills[r] and (np.flatnonzero(pad) >= fills[r]).all()  # padding at the end
        for k, i in enumerate(members):
            where = np.flatnonzero(seg == k)
            assert row.position_ids[where].tolist() == list(range(samples[i].positions))  # restart at 0
            assert row.loss_mask[where].tolist() == samples[i].assistant_mask[1:].astype(np.float32).tolist()
        assert (row.loss_mask[pad] == 0).all() and (row.position_ids[pad] == 0).all()
        # no label crosses a boundary: every sample comes back whole, its last label its own last token
        assert [s.tolist() for s in unpack_row(row)] == [samples[i].token_ids.tolist() for i in members]
        masked = batch["attention_mask"][r, 0].numpy()
        q, k_ = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
        same = (seg[:, None] == seg[None, :]) & ~pad[:, None]
        assert masked[seg[:, None] != seg[None, :]].all()  # every cross-sample pair is blocked
        assert (~masked[same & (k_ <= q)]).all() and masked[same & (k_ > q)].all()  # causal within a sample
        assert (~masked[pad, pad]).all() and masked[pad].sum() == pad.sum() * (seq_len - 1)  # padding: itself


def test_packing_real_samples(template: ChatMLTemplate):
    convs = [MULTI_TURN, conv(("user", "Say hi."), ("assistant", "hi")),
             conv(("user", "What is the capital of France?"), ("assistant", "Paris.")),
             conv(("system", "Be brief."), ("user", "Translate: good morning"), ("assistant", "Bonjour!"))] * 3
    samples = tokenize_conversations(convs, template, seq_len=96)
    plan = plan_rows([s.positions for s in samples], 96)
    rows = [pack_row([samples[i] for i in row], 96) for row in plan]
    assert len(rows) < len(samples)  # something was packed together
    check_rows(samples, plan, rows, 96)


@settings(max_examples=60, deadline=None)
@given(seq_len=st.integers(1, 48), data=st.data())
def test_packing_invariants_hold_for_any_lengths(seq_len: int, data: st.DataObject):
    lengths = data.draw(st.lists(st.integers(2, seq_len + 1), min_size=1, max_size=24), label="lengths")
    samples = synthetic_samples(lengths, seed=data.draw(st.integers(0, 2**16), label="seed"))
    plan = plan_rows([s.positions for s in samples], seq_len)
    rows = [pack_row([samples[i] for i in row], seq_len, pad_id=0) for row in plan]
    check_rows(samples, plan, rows, seq_len)


def test_a_sample_that_does_not_fit_is_refused():
    with pytest.raises(SFTDataError, match="s0: 10 tokens do not fit a row of seq_len=8"):
        SFTBatches(synthetic_samples([10], 0), seq_len=8, batch_size=2)


# --- batches ---------------------------------------------------------------------------------


def take(batches: SFTBatches, k: int) -> list[dict[str, torch.Tensor]]:
    return [next(batches) for _ in range(k)]


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
                                    for x, y in zip(a, b, strict=True))


def test_batches_shapes_and_one_epoch_covers_every_sample_once(template: ChatMLTemplate, tmp_path: Path):
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]} for i in range(23)])
    samples = tokenize_conversations(read_conversations(path), template, seq_len=64)
    batches = SFTBatches(samples, seq_len=64, batch_size=3, seed=1, epochs=1)
    got = list(batches)
    assert len(got) == batches.batches_in_epoch(0) >= 2
    for b in got:
        assert b.keys() == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
        assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == b["position_ids"].shape == (3, 64)
        assert b["attention_mask"].shape == (3, 1, 64, 64) and b["attention_mask"].dtype == torch.bool
        assert b["tokens"].dtype == b["labels"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
    answers = sorted(decode(template.tokenizer, b["labels"][r][a:e])
                     for b in got for r in range(3) for a, e in runs(b["loss_mask"][r].numpy() > 0))
    assert answers == sorted(f"{i} + {i} = {2 * i}.<|im_end|>" for i in range(23))
    last = got[-1]
    empty_rows = -len(batches.rows(0)) % 3
    assert all(last["loss_mask"][r].sum() == 0 for r in range(3 - empty_rows, 3))  # filler rows train nothing


def test_batches_are_deterministic_given_the_seed():
    samples = synthetic_samples([5, 9, 3, 17, 2, 8, 12, 4, 6, 7, 11, 3], seed=0)
    a = take(SFTBatches(samples, seq_len=20, batch_size=2, seed=3), 8)
    b = take(SFTBatches(samples, seq_len=20, batch_size=2, seed=3), 8)
    c = take(SFTBatches(samples, seq_len=20, batch_size=2, seed=4), 8)
    assert same_batches(a, b) and not same_batches(a, c)


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5, 7])  # 3 batches an epoch: resume inside and across epochs
def test_resume_gives_the_same_next_batches(consumed: int):
    samples = synthetic_samples([5, 9, 3, 17, 2, 8, 12, 4, 6, 7, 11, 3, 15, 2], seed=0)
    run = SFTBatches(samples, seq_len=20, batch_size=2, seed=5)
    assert run.batches_in_epoch(0) == 3
    take(run, consumed)
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint would store it
    expected = take(run, 5)
    resumed = SFTBatches(samples, seq_len=20, batch_size=2, seed=5)
    resumed.load_state_dict(state)
    assert same_batches(take(resumed, 5), expected)


def test_resume_with_other_settings_is_refused():
    samples = synthetic_samples([5, 9, 3, 17], seed=0)
    state = SFTBatches(samples, seq_len=20, batch_size=2, seed=5).state_dict()
    with pytest.raises(SFTDataError, match="saved state has seed=5 but these batches have seed=6"):
        SFTBatches(samples, seq_len=20, batch_size=2, seed=6).load_state_dict(state)
    with pytest.raises(SFTDataError, match="num_samples=4 but these batches have num_samples=3"):
        SFTBatches(samples[:3], seq_len=20, batch_size=2, seed=5).load_state_dict(state)
