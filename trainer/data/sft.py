"""Supervised fine-tuning data for causal LMs: chat jsonl in, packed megatron-core batches out.

The pipeline, one function or class per step::

    convs = read_conversations("train.jsonl")              # alpaca / sharegpt / messages
    template = chat_template(load_tokenizer("tok/"))       # ChatML, or the tokenizer's own
    samples = tokenize_conversations(convs, template, seq_len=2048)
    batches = SFTBatches(samples, seq_len=2048, batch_size=8, seed=0)
    batch = next(batches)   # tokens, labels, loss_mask, position_ids, attention_mask

**Formats** (one JSON object per line; detected from a file's first record, or forced with
``format=``). All become a tuple of ``(role, content)`` turns, roles ``system``, ``user``,
``assistant``:

- ``alpaca``: ``{"instruction", "input"?, "output", "system"?}`` → [system], user, assistant.
  A non-empty ``input`` is appended to the instruction after a blank line.
- ``sharegpt``: ``{"conversations": [{"from": "system"|"human"|"gpt", "value"}]}``.
- ``messages`` (OpenAI): ``{"messages": [{"role": "system"|"user"|"assistant", "content"}]}``.

A conversation needs at least one assistant turn; it may end on any turn (later turns are
context that is never trained). Other keys are ignored.

**Chat template.** The default is ChatML: every turn renders as
``<|im_start|>{role}\\n{content}<|im_end|>\\n``, with no BOS. Both special tokens must be
single tokens of the tokenizer. ``chat_template(tok, "tokenizer")`` uses the tokenizer's own
Jinja ``chat_template`` through ``apply_chat_template`` instead.

**Trained tokens.** A conversation is split into alternating prompt and completion segments,
each tokenised on its own (no special tokens added) and concatenated, so a prompt tokenises
exactly as it will at inference (rendered up to and including the assistant header). A
completion is an assistant turn's content plus its end-of-turn marker (``<|im_end|>`` for
ChatML; with a tokenizer template, whatever the template writes after the content, less
trailing whitespace). ``TokenizedSample.assistant_mask`` is True exactly on completion tokens:
not on role headers, system or user text, or the newline after ``<|im_end|>``.

**Labels and loss mask (next-token prediction).** A sample of n tokens ``t[0..n-1]`` with
assistant mask ``a`` occupies n-1 row positions. At sample position j (0 ≤ j < n-1)::

    tokens[j] = t[j]    labels[j] = t[j+1]    loss_mask[j] = a[j+1]    position_ids[j] = j

so the loss at a position trains the prediction of the *next* token, and counts iff that
token is an assistant token. The last token of a sample is a label only, so no position ever
predicts across a sample boundary.

**Truncation** (``tokenize_conversations(..., truncation=)``): a row holds ``seq_len``
positions, so a sample may have at most ``seq_len + 1`` tokens. ``"truncate"`` (default) keeps
its first ``seq_len + 1`` tokens (the prompt survives, the end of a long answer is cut);
``"drop"`` skips it. Either way a sample left with no trained label is skipped, and skips are
logged with a count.

**Packing.** Samples are packed into rows of ``seq_len`` positions by best fit (each sample
goes to the open row with the least room that still fits it; ties go to the oldest row).
Each row has, besides the above, per position:

- padding after the last sample: ``tokens = labels = pad_id``, ``loss_mask = 0``,
  ``position_ids = 0``; labels are always valid vocabulary ids (never -100).
- ``attention_mask``: megatron-core's convention, bool ``[batch, 1, seq, seq]`` where **True
  means masked out**. Query i may attend key j iff both are in the same sample and j ≤ i
  (block-diagonal causal). A padding position attends only itself, so no softmax row is
  empty (no NaN) and padding never touches a sample.

**Batches.** ``SFTBatches`` shuffles the samples with ``(seed, epoch)``, packs them, shuffles
the rows and yields ``batch_size`` rows at a time; an epoch's last batch is filled with
all-padding rows (loss 0). ``state_dict()`` records (epoch, batch); a new ``SFTBatches`` over
the same samples with ``load_state_dict()`` yields the same batches from there.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from trainer.tokenizer import load_tokenizer  # noqa: F401 - part of this module's API (see the docstring)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]
Turn = tuple[Role, str]
Format = Literal["alpaca", "sharegpt", "messages"]
FORMATS: tuple[Format, ...] = ("alpaca", "sharegpt", "messages")
Truncation = Literal["truncate", "drop"]

SHAREGPT_ROLES: dict[str, Role] = {"system": "system", "human": "user", "gpt": "assistant"}
MESSAGE_ROLES: tuple[Role, ...] = ("system", "user", "assistant")


class SFTDataError(ValueError):
    """SFT data or a tokenizer that cannot be used; the message names the input, the problem and the fix."""


# --- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """One training example: its turns, and where it came from (``path:line``) for messages."""

    turns: tuple[Turn, ...]
    origin: str


class _Malformed(Exception):
    """A record's problem, without its location (read_conversations adds that)."""


def _detect_format(record: Any) -> Format:
    """The format of one parsed jsonl record, from its keys."""
    if isinstance(record, dict):
        for key, fmt in (("messages", "messages"), ("conversations", "sharegpt"), ("instruction", "alpaca")):
            if key in record:
                return fmt
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise _Malformed(f"cannot tell the format from {keys}: expected a 'messages' (OpenAI), "
                     "'conversations' (sharegpt) or 'instruction' (alpaca) key; "
                     f"fix the record or pass format= one of {', '.join(FORMATS)}")


def read_conversations(path: str | Path, format: Format | Literal["auto"] = "auto") -> list[Conversation]:
    """Every conversation of a jsonl file; blank lines are skipped.

    With ``format="auto"`` the file's first record decides the format and every line must
    follow it. Raises SFTDataError naming the file, the 1-based line and the problem.
    """
    path = Path(path)
    if format != "auto" and format not in FORMATS:
        raise SFTDataError(f"format={format!r} is not known; use 'auto' or one of {', '.join(FORMATS)}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SFTDataError(f"{path}: cannot read SFT data ({e}); pass an existing UTF-8 jsonl file") from e
    fmt: Format | None = None if format == "auto" else format
    conversations = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise _Malformed(f"not valid JSON ({e.msg} at column {e.colno})") from None
            if fmt is None:
                fmt = _detect_format(record)
                log.debug("%s: %s format (detected from line %d)", path, fmt, number)
            turns = _PARSERS[fmt](record)
        except _Malformed as e:
            how = "forced by format=" if format != "auto" else "detected from the file's first record"
            raise SFTDataError(f"{path}:{number}: {e} [{fmt or 'unknown'} format, {how}]") from None
        conversations.append(Conversation(turns, f"{path}:{number}"))
    if not conversations:
        raise SFTDataError(f"{path}: no conversations (the file is empty); pass a jsonl file with one record per line")
    return conversations


def _field(record: dict[str, Any], key: str, kind: type, where: str = "") -> Any:
    if key not in record:
        raise _Malformed(f"{where}missing {key!r} (has {sorted(record)})")
    value = record[key]
    if not isinstance(value, kind):
        raise _Malformed(f"{where}{key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _object(record: Any, where: str = "") -> dict[str, Any]:
    if not isinstance(record, dict):
        raise _Malformed(f"{where}expected a JSON object, got {type(record).__name__}")
    return record


def _checked(turns: list[Turn]) -> tuple[Turn, ...]:
    if not any(role == "assistant" for role, _ in turns):
        raise _Malformed(f"no assistant turn (roles: {', '.join(r for r, _ in turns)}), so nothing to train on; "
                         "add the assistant's reply or drop the record")
    return tuple(turns)


def _alpaca(record: Any) -> tuple[Turn, ...]:
    record = _object(record)
    instruction = _field(record, "instruction", str)
    extra = _field(record, "input", str) if "input" in record else ""
    output = _field(record, "output", str)
    turns: list[Turn] = []
    if "system" in record:
        turns.append(("system", _field(record, "system", str)))
    turns.append(("user", f"{instruction}\n\n{extra}" if extra else instruction))
    turns.append(("assistant", output))
    return tuple(turns)


def _turn_list(record: Any, key: str, role_key: str, text_key: str,
               roles: dict[str, Role]) -> tuple[Turn, ...]:
    items = _field(_object(record), key, list)
    if not items:
        raise _Malformed(f"{key!r} is empty; a conversation needs at least one assistant turn")
    turns: list[Turn] = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]: "
        item = _object(item, where)
        role = _field(item, role_key, str, where)
        if role not in roles:
            raise _Malformed(f"{where}unknown {role_key} {role!r}; expected one of {', '.join(roles)}")
        turns.append((roles[role], _field(item, text_key, str, where)))
    return _checked(turns)


def _sharegpt(record: Any) -> tuple[Turn, ...]:
    return _turn_list(record, "conversations", "from", "value", SHAREGPT_ROLES)


def _messages(record: Any) -> tuple[Turn, ...]:
    return _turn_list(record, "messages", "role", "content", {r: r for r in MESSAGE_ROLES})


_PARSERS = {"alpaca": _alpaca, "sharegpt": _sharegpt, "messages": _messages}


# --- templates and tokenisation --------------------------------------------------------------


class ChatTemplate(Protocol):
    """Renders turns as alternating prompt/completion text segments for one tokenizer."""

    tokenizer: PreTrainedTokenizerBase

    def segments(self, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
        """``(text, trained)`` pieces whose concatenation is the rendered conversation."""
        ...


class ChatMLTemplate:
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn; trains on content + ``<|im_end|>``."""

    START = "<|im_start|>"
    END = "<|im_end|>"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        for token in (self.START, self.END):
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise SFTDataError(
                    f"the tokenizer ({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has no "
                    f"single token for {token!r}, which the ChatML template needs (it encodes as {ids}); add it with "
                    f"tokenizer.add_special_tokens({{'additional_special_tokens': ['{self.START}', '{self.END}']}}) "
                    "and resize the model's embeddings, or use the tokenizer's own template (template='tokenizer')")
        self.tokenizer = tokenizer

    def segments(self, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        prompt = ""
        for role, content in turns:
            prompt += f"{self.START}{role}\n"
            if role == "assistant":
                out += [(prompt, False), (f"{content}{self.END}", True)]
                prompt = "\n"
            else:
                prompt += f"{content}{self.END}\n"
        out.append((prompt, False))
        return out


class TokenizerChatTemplate:
    """The tokenizer's own Jinja ``chat_template``, split into segments by rendering prefixes.

    For the k-th assistant turn, the prompt ends where ``render(turns[:k], add_generation_prompt=True)``
    ends and the completion where ``render(turns[:k+1])`` ends, less trailing whitespace. This
    needs a template that renders a conversation's prefix as a prefix of its text (most do;
    ones that rewrite earlier turns, such as dropping past reasoning, do not).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        template = getattr(tokenizer, "chat_template", None)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not template:
            raise SFTDataError(f"the tokenizer ({name}) has no chat_template; use the built-in ChatML template "
                               "(template='chatml') or set tokenizer.chat_template")
        if not isinstance(template, str):
            raise SFTDataError(f"the tokenizer ({name}) has several named chat templates; "
                               "set tokenizer.chat_template to the one to train with")
        for attr in ("bos_token", "eos_token"):
            if attr in template and getattr(tokenizer, attr, None) is None:
                raise SFTDataError(f"the tokenizer's ({name}) chat_template uses {attr} but the tokenizer has none; "
                                   f"set tokenizer.{attr} (e.g. in tokenizer_config.json)")
        self.tokenizer = tokenizer

    def _render(self, turns: Sequence[Turn], generation_prompt: bool) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # a Jinja template can raise anything; say which conversation
            raise SFTDataError(f"the tokenizer's chat_template failed on roles {[r for r, _ in turns]} ({e}); "
                               "fix the template or use template='chatml'") from e

    def segments(self, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        done = ""  # rendered text already assigned to segments
        for k, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            prompt = self._render(turns[:k], generation_prompt=True)
            full = self._render(turns[: k + 1], generation_prompt=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise SFTDataError(f"the tokenizer's chat_template does not render turn {k} of this conversation "
                                   "after the text of the earlier turns (it rewrites them), so trained tokens "
                                   "cannot be located; use template='chatml'")
            completion = full[len(prompt):].rstrip()
            out += [(prompt[len(done):], False), (completion, True)]
            done = prompt + completion
        rest = self._render(turns, generation_prompt=False)
        if not rest.startswith(done):
            raise SFTDataError("the tokenizer's chat_template renders the whole conversation differently from its "
                               "prefixes, so trained tokens cannot be located; use template='chatml'")
        out.append((rest[len(done):], False))
        return out


def chat_template(tokenizer: PreTrainedTokenizerBase, name: Literal["chatml", "tokenizer"] = "chatml") -> ChatTemplate:
    """The template to train with: built-in ChatML, or the tokenizer's own ``chat_template``."""
    if name == "chatml":
        return ChatMLTemplate(tokenizer)
    if name == "tokenizer":
        return TokenizerChatTemplate(tokenizer)
    raise SFTDataError(f"template={name!r} is not known; use 'chatml' or 'tokenizer'")


@dataclass(frozen=True, eq=False)
class TokenizedSample:
    """A rendered, tokenised conversation: ids ``[n]`` and which of them are assistant output."""

    token_ids: np.ndarray  # int64 [n]
    assistant_mask: np.ndarray  # bool [n]: the completion tokens (assistant content + end of turn)
    origin: str

    @property
    def positions(self) -> int:
        """Row positions it occupies when packed (n - 1: the last token is only a label)."""
        return len(self.token_ids) - 1


def tokenize_conversation(conversation: Conversation, template: ChatTemplate) -> TokenizedSample:
    """Token ids and assistant mask of one conversation, segment by segment (see the module doc)."""
    segments = [(text, trained) for text, trained in template.segments(conversation.turns) if text]
    encoded = template.tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
    ids = np.fromiter((i for piece in encoded for i in piece), dtype=np.int64)
    mask = np.concatenate([np.full(len(piece), trained, dtype=bool)
                           for piece, (_, trained) in zip(encoded, segments, strict=True)] or [np.zeros(0, bool)])
    return TokenizedSample(ids, mask, conversation.origin)


def fit_to_length(sample: TokenizedSample, seq_len: int, truncation: Truncation = "truncate") -> TokenizedSample | None:
    """The sample cut to at most ``seq_len + 1`` tokens, or None when the policy or an empty loss drops it."""
    if truncation not in ("truncate", "drop"):
        raise SFTDataError(f"truncation={truncation!r} is not known; use 'truncate' or 'drop'")
    if sample.positions > seq_len:
        if truncation == "drop":
            return None
        sample = TokenizedSample(sample.token_ids[: seq_len + 1], sample.assistant_mask[: seq_len + 1], sample.origin)
    if not sample.assistant_mask[1:].any():
        return None
    return sample


def tokenize_conversations(conversations: Sequence[Conversation], template: ChatTemplate, *, seq_len: int,
                           truncation: Truncation = "truncate") -> list[TokenizedSample]:
    """Every conversation tokenised and fitted to rows of ``seq_len`` positions; skips are logged."""
    samples, cut, skipped = [], 0, []
    for conversation in conversations:
        sample = tokenize_conversation(conversation, template)
        fitted = fit_to_length(sample, seq_len, truncation)
        if fitted is None:
            skipped.append(conversation.origin)
            continue
        cut += len(fitted.token_ids) < len(sample.token_ids)
        samples.append(fitted)
    if cut:
        log.warning("%d of %d conversations truncated to %d tokens (seq_len %d)",
                    cut, len(conversations), seq_len + 1, seq_len)
    if skipped:
        log.warning("%d of %d conversations skipped (%s, or no assistant token left to train), first: %s",
                    len(skipped), len(conversations), "longer than seq_len" if truncation == "drop" else "truncated",
                    skipped[0])
    if not samples:
        raise SFTDataError(f"none of {len(conversations)} conversations has an assistant token within "
                           f"seq_len={seq_len}; raise seq_len or shorten the prompts")
    return samples


# --- packing ---------------------------------------------------------------------------------


def plan_rows(sizes: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit packing: for each row, the indices of the items (of ``sizes`` positions) it holds.

    Items are placed in the given order; each goes to the open row with the least room that
    still fits it (the oldest such row on ties), or starts a new row.
    """
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row index), sorted; full rows leave it
    for item, size in enumerate(sizes):
        if not 0 < size <= seq_len:
            raise SFTDataError(f"item {item} needs {size} positions, outside 1..seq_len={seq_len}; "
                               "fit samples with fit_to_length() first")
        at = bisect.bisect_left(room, (size, -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(item)
        if free > size:
            bisect.insort(room, (free - size, row))
    return rows


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One row of ``seq_len`` positions holding whole samples, then padding (see the module doc)."""

    tokens: np.ndarray  # int64 [s]
    labels: np.ndarray  # int64 [s]
    loss_mask: np.ndarray  # float32 [s]
    position_ids: np.ndarray  # int64 [s]
    segment_ids: np.ndarray  # int64 [s]: the sample's index within the row, -1 on padding


def pack_row(samples: Sequence[TokenizedSample], seq_len: int, pad_id: int = 0) -> PackedRow:
    """Lay samples end to end in one row, shifted for next-token prediction, then pad."""
    tokens = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_len, dtype=np.float32)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    segment_ids = np.full(seq_len, -1, dtype=np.int64)
    at = 0
    for index, sample in enumerate(samples):
        n = sample.positions
        if at + n > seq_len:
            raise SFTDataError(f"samples {[s.origin for s in samples]} need more than seq_len={seq_len} positions; "
                               "pack them with plan_rows()")
        tokens[at:at + n] = sample.token_ids[:-1]
        labels[at:at + n] = sample.token_ids[1:]
        loss_mask[at:at + n] = sample.assistant_mask[1:]
        position_ids[at:at + n] = np.arange(n)
        segment_ids[at:at + n] = index
        at += n
    return PackedRow(tokens, labels, loss_mask, position_ids, segment_ids)


def unpack_row(row: PackedRow) -> list[np.ndarray]:
    """The full token ids of each sample in a row (inputs plus the final label)."""
    out = []
    for index in range(int(row.segment_ids.max()) + 1):
        where = np.flatnonzero(row.segment_ids == index)
        out.append(np.append(row.tokens[where], row.labels[where[-1]]))
    return out


def attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask ``[b, 1, s, s]`` from segment ids ``[b, s]``; True = masked out.

    Query i attends key j iff they share a segment (id ≥ 0) and j ≤ i; a padding position
    (id -1) attends only itself.
    """
    s = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal & (segment_ids[:, :, None] >= 0)
    allowed |= torch.eye(s, dtype=torch.bool, device=segment_ids.device)
    return (~allowed).unsqueeze(1)


def collate(rows: Sequence[PackedRow]) -> dict[str, torch.Tensor]:
    """Rows stacked into the batch megatron-core's GPT model takes."""
    def stack(name: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([getattr(row, name) for row in rows]))

    return {"tokens": stack("tokens"), "labels": stack("labels"), "loss_mask": stack("loss_mask"),
            "position_ids": stack("position_ids"), "attention_mask": attention_mask(stack("segment_ids"))}


# --- batches ---------------------------------------------------------------------------------


class SFTBatches:
    """Packed SFT batches, reshuffled each epoch, deterministic given the seed and resumable.

    Yields dicts ``tokens``, ``labels`` (int64 ``[b, s]``), ``loss_mask`` (float32 ``[b, s]``),
    ``position_ids`` (int64 ``[b, s]``) and ``attention_mask`` (bool ``[b, 1, s, s]``, True =
    masked). Runs for ``epochs`` epochs, or forever when None.
    """

    def __init__(self, samples: Sequence[TokenizedSample], *, seq_len: int, batch_size: int, seed: int = 0,
                 pad_id: int = 0, epochs: int | None = None) -> None:
        if seq_len < 1 or batch_size < 1:
            raise SFTDataError(f"seq_len={seq_len} and batch_size={batch_size} must both be at least 1")
        if not samples:
            raise SFTDataError("no samples to batch; tokenize_conversations() found none")
        for sample in samples:
            if not 0 < sample.positions <= seq_len:
                raise SFTDataError(f"{sample.origin}: {len(sample.token_ids)} tokens do not fit a row of "
                                   f"seq_len={seq_len} positions (at most seq_len + 1 tokens); "
                                   "make samples with tokenize_conversations(..., seq_len=seq_len)")
        self.samples = list(samples)
        self.seq_len, self.batch_size, self.seed, self.pad_id, self.epochs = seq_len, batch_size, seed, pad_id, epochs
        self.epoch, self.batch = 0, 0  # the next batch to yield
        self._rows: tuple[int, list[list[int]]] | None = None  # (epoch, rows of sample indices)

    def rows(self, epoch: int) -> list[list[int]]:
        """The sample indices of each row of an epoch, in yield order."""
        if self._rows is None or self._rows[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self.samples))
            rows = [[int(order[i]) for i in row]
                    for row in plan_rows([self.samples[i].positions for i in order], self.seq_len)]
            self._rows = (epoch, [rows[i] for i in rng.permutation(len(rows))])
        return self._rows[1]

    def batches_in_epoch(self, epoch: int) -> int:
        return -(-len(self.rows(epoch)) // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        rows = self.rows(self.epoch)
        picked = rows[self.batch * self.batch_size:(self.batch + 1) * self.batch_size]
        packed = [pack_row([self.samples[i] for i in row], self.seq_len, self.pad_id) for row in picked]
        packed += [pack_row([], self.seq_len, self.pad_id)] * (self.batch_size - len(packed))
        self.batch += 1
        if self.batch * self.batch_size >= len(rows):
            self.epoch, self.batch = self.epoch + 1, 0
        return collate(packed)

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, and what it is only valid for."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a ``state_dict()`` taken from batches over the same samples and settings."""
        for key in ("seed", "seq_len", "batch_size", "num_samples"):
            mine = len(self.samples) if key == "num_samples" else getattr(self, key)
            if state.get(key) != mine:
                raise SFTDataError(f"cannot resume SFT batches: the saved state has {key}={state.get(key)} but "
                                   f"these batches have {key}={mine}; resume with the same data and settings")
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= batch < max(self.batches_in_epoch(epoch), 1):
            raise SFTDataError(f"cannot resume SFT batches at epoch {epoch}, batch {batch}: "
                               f"epoch {epoch} has {self.batches_in_epoch(epoch)} batches; the state is corrupt")
        self.epoch, self.batch = epoch, batch
