"""Batch init: which tokens a step computes, and its metadata in one preallocated buffer, copied to the device once.

Every per-step tensor the layers read (AttentionMetadata, LoRABatch, token ids, positions) is a view into one
int64 buffer: filled on the host (pinned on CUDA), copied with one non-blocking copy, then sliced. Nothing here
builds a tensor from a Python list on the device, and nothing reads the device back.

Decode-only steps, the common case, take a vectorised path whose layout depends only on the padded batch size and
whether adapters are present: its views are cached per layout, and a decode CUDA graph finds its inputs at the
same addresses every time (cuda_graphs).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import EngineConfig
from ..model.forward_batch import PLACEHOLDER_KEYS, AttentionMetadata, LoRABatch
from ..sequence import Sequence
from .cuda_graphs import GraphShape


@dataclass(slots=True)
class Planned:
    seq: Sequence
    start: int  # first position computed this step
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


def attention_rows(chunks: list[Planned]) -> list[Planned]:
    """The prefill group's rows: one per chunk, but a lone chunk as its two halves. The group has at least two
    rows (compile_policy: no 0/1 specialisation), all as wide as the longest, and a padding row costs attention
    as much as a real one: a lone 256-token chunk attended 2 x 256 queries. As halves it attends 2 x 128 (the
    second half reads the first's keys, written earlier in the same step)."""
    if len(chunks) != 1 or chunks[0].length < 2:
        return chunks
    p = chunks[0]
    half = (p.length + 1) // 2
    return [Planned(p.seq, p.start, half), Planned(p.seq, p.start + half, p.length - half)]


@dataclass
class StepInputs:
    """One step's device inputs (views into the metadata buffer) and the sequences it samples."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    lora: LoRABatch
    logits_idx: torch.Tensor
    sampled: list[Sequence]
    num_adapters: int  # distinct adapters in the step
    # Prompt log-probabilities: logits rows after the sampled ones (logits_idx), each sequence with its number of
    # rows, in order, and the prompt token each row scores (the next position's).
    prompt_rows: list[tuple[Sequence, int]] = field(default_factory=list)
    prompt_targets: torch.Tensor | None = None

    def addresses(self) -> tuple[int, ...]:
        """Where every input a decode graph reads lives: equal between steps of one graph shape."""
        tensors = (self.input_ids, self.positions, *vars(self.attn).values(), self.lora.weight_indices)
        return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _lora_slot(p: Planned) -> int:
    return p.seq.lora_slot


# The buffer's columns, in order; each step fills them back to back and reads each back as a view by name. The
# decode block table, whose width follows the keys read, comes last but for logits_idx and prompt_targets: a decode
# step's other columns lie at offsets that depend on its row count alone (cached views; a CUDA graph's fixed addresses).
COLUMNS = ("input_ids", "positions", "slot_mapping", "decode_token_idx", "decode_q_pos", "prefill_token_idx",
           "prefill_q_pos", "out_idx", "weight_indices", "prefill_block_table", "decode_block_table", "logits_idx",
           "prompt_targets")
_MATRICES = ("prefill_token_idx", "prefill_q_pos", "prefill_block_table", "decode_block_table")
# Logits rows a step computes for prompt log-probabilities, at most ((rows, vocab) float32 and its log-softmax): a
# prompt that asks for them is prefilled in chunks that fit.
PROMPT_LOGITS_BYTES = 128 << 20


def prompt_logprob_span(seq: Sequence, start: int, length: int) -> tuple[int, int]:
    """The positions [first, end) of a chunk at [start, start + length) whose logits give prompt log-probabilities
    still owed (position p scores prompt token p + 1); empty where the chunk starts past the next one owed."""
    owed = len(seq.prompt_logprobs) if seq.prompt_logprobs_pending else len(seq.prompt_ids)
    if start > owed:
        return start, start
    return owed, max(owed, min(start + length, len(seq.prompt_ids) - 1))


def table_width(keys: int, block_size: int) -> int:
    """Blocks a group's block table lists to cover `keys` positions (>= 2: a dynamic dim, never specialised)."""
    return max(2, -(-keys // block_size))


class BatchInit:
    def __init__(self, config: EngineConfig, device: torch.device, vocab_size: int, overlap: bool = False):
        """`overlap`: a decode step may be filled ahead, while the step before it runs (step_ahead): a second host
        buffer to fill while the first one's copy may still be queued, and a device buffer of its own on the CPU."""
        self.budget = config.max_num_batched_tokens
        self.max_prompt_logits_rows = max(1, PROMPT_LOGITS_BYTES // (4 * vocab_size))
        self.block_size = config.block_size
        max_tokens = config.max_num_batched_tokens + 1
        self.arange = torch.arange(max(config.max_seq_len, max_tokens), device=device)
        rows = config.max_num_seqs + 2
        width = table_width(config.max_seq_len, config.block_size)
        # Per token: ids, positions, slot_mapping, out_idx, weight_indices, prompt logits row and target; per
        # sequence: decode index and position, sampled row; per prefill row: token index and position of each
        # column; block tables.
        capacity = 7 * max_tokens + 3 * rows + 2 * rows * max_tokens + 2 * rows * width + 64
        self._hosts = [torch.zeros(capacity, dtype=torch.int64, pin_memory=device.type == "cuda")
                       for _ in range(2 if overlap else 1)]
        self._select(0)
        self.device_buf = (self.host if device.type == "cpu" and not overlap
                           else torch.zeros_like(self.host, device=device))
        self._decode_views: dict[tuple[int, bool], dict[str, torch.Tensor]] = {}

    def _select(self, buffer: int) -> None:
        """Fill host buffer `buffer` from now on."""
        self.buffer = buffer
        self.host = self._hosts[buffer]
        self.np = self.host.numpy()

    def build_ahead(self, single: list[Planned], merged: bool, graph: GraphShape | None) -> tuple[StepInputs, int]:
        """A decode step's inputs filled in the spare host buffer and copied (the step's one copy, queued behind the
        running step), all but the input ids: the running step's sampler writes those on the device
        (`next_input_ids`). Returns (inputs, buffer), for take_ahead."""
        current, spare = self.buffer, 1 - self.buffer
        self._select(spare)
        try:
            inputs, total = self._build_decode(single, merged, graph, write_ids=False)
            self._copy(total)
        finally:
            self._select(current)
        return inputs, spare

    def take_ahead(self, buffer: int) -> None:
        """A step built ahead runs: its host buffer is the current one, the other is filled next."""
        self._select(buffer)

    def plan(self, seqs: SequenceLike[Sequence]) -> tuple[list[Planned], list[Planned]]:
        """Split the step's token budget: every sequence with one token left (its last, which samples) first,
        grouped by LoRA slot, then prefill chunks in order; a chunk the budget would cut to under half the step's
        widest waits for the next step."""
        single, rest = [], []
        for seq in seqs:  # one pass: each sequence's count read once (a decode step's whole plan is this loop)
            computed = seq.num_computed_tokens
            remaining = len(seq.prompt_ids) + len(seq.output_ids) - computed
            assert seq.block_table and remaining >= 1 and seq.finish_reason is None, "sequence not runnable"
            if remaining == 1:
                single.append(Planned(seq, computed, 1))
            else:
                rest.append((seq, computed, remaining))
        budget = self.budget - len(single)
        rows_left = self.max_prompt_logits_rows
        chunks, widest = [], 0
        for seq, computed, remaining in rest:
            if budget <= 0:
                break
            n = min(remaining, budget)
            if n < remaining and 2 * n < widest:
                # Cut by the budget to under half the step's widest chunk, it waits for the next step: every
                # attention row is as wide as the widest, so its row would cost as much attention as that chunk's,
                # and it would not finish this step anyway (8 prompts of 1,000 tokens, a 488-token tail beside a
                # 24-token head: docs/benchmarks.md, "Prefill").
                continue
            if seq.prompt_logprobs_pending:  # its chunk is cut to the logits rows left (the rest waits)
                first, end = prompt_logprob_span(seq, computed, n)
                if end - first > rows_left:
                    n = first - computed + rows_left
                rows_left -= min(end - first, rows_left)
                if n <= 0:
                    continue
            budget -= n
            widest = max(widest, n)
            chunks.append(Planned(seq, computed, n))  # a one-token chunk too: `single` holds last tokens only
        # One adapter's tokens side by side: the LoRA kernels then read a slot's weights from memory once and from
        # cache for its next tokens (batch 32, 8 adapters: 3-10 % less per step than interleaved;
        # python -m benchmarks.lora_layer --engine).
        single.sort(key=_lora_slot)
        return single, chunks

    def build(self, single: list[Planned], chunks: list[Planned], merged: bool = False,
              graph: GraphShape | None = None) -> StepInputs:
        """The step's inputs. `merged`: the step runs on its adapter merged into the weights (no LoRA work).
        `graph`: a decode step padded to a CUDA graph's shape (cuda_graphs)."""
        if single and not chunks:
            inputs, total = self._build_decode(single, merged, graph)
            self._copy(total)
            return inputs
        assert graph is None, "only decode steps are padded"
        return self._build_general(single, chunks, merged)

    def _check(self, total: int) -> None:
        if total > self.np.shape[0]:
            raise RuntimeError(f"step metadata needs {total} entries, buffer holds {self.np.shape[0]}")

    def _copy(self, total: int) -> None:
        if self.device_buf is not self.host:
            self.device_buf[:total].copy_(self.host[:total], non_blocking=True)  # the step's one host-to-device copy

    def _fill_table(self, start: int, seqs: list[Sequence], n_rows: int, width: int) -> None:
        """Block tables of `seqs` as an (n_rows, width) matrix at `start`; the rest is the null block."""
        table = self.np[start:start + n_rows * width].reshape(n_rows, width)
        table[:] = 0
        for i, seq in enumerate(seqs):
            blocks = seq.block_table[:width]
            table[i, :len(blocks)] = blocks

    def _build_decode(self, single: list[Planned], merged: bool, graph: GraphShape | None,
                      write_ids: bool = True) -> tuple[StepInputs, int]:
        """A decode-only step, laid out as _build_general lays it out, with whole-column numpy writes, and the
        entries to copy. Padding rows (up to graph.rows) and the dummy token decode token 0 at position 0 into
        the null block."""
        n = len(single)
        rows = graph.rows if graph is not None else n
        t, n_dec = rows + 1, max(2, rows)  # tokens (+ the dummy), decode rows (>= 2)
        bs = self.block_size
        seqs = [p.seq for p in single]
        pos = np.fromiter((p.start for p in single), np.int64, n)
        slots = np.fromiter((p.seq.slot_at(p.start) for p in single), np.int64, n)
        rows_written = np.fromiter((p.seq.block_table[p.start // bs] * bs + p.start % bs for p in single),
                                   np.int64, n)
        keys = graph.keys if graph is not None else max(2, int(pos.max()) + 1)
        width = table_width(keys, bs)
        adapters = set(slots.tolist()) - {0}
        lora = bool(adapters) and not merged
        self._check(6 * t + 2 * n_dec + 12 + n_dec * width + n)
        b = self.np
        # input_ids, positions, slot_mapping: the real tokens, then padding and the dummy.
        if write_ids:
            b[0:n] = np.fromiter((s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs), np.int64, n)
        b[n:t] = 0
        b[t:t + n], b[t + n:2 * t] = pos, 0
        b[2 * t:2 * t + n], b[2 * t + n:3 * t] = rows_written, 0
        o = 3 * t
        b[o:o + n_dec] = np.arange(n_dec)  # decode_token_idx (with one row, its second is the dummy: index 1)
        b[o + n_dec:o + n_dec + n], b[o + n_dec + n:o + 2 * n_dec] = pos, 0
        o += 2 * n_dec
        b[o:o + 4], b[o + 4:o + 8] = rows, 0  # placeholder prefill group: 2x2 of the dummy
        o += 8
        b[o:o + rows], b[o + rows] = np.arange(rows), 0  # out_idx
        o += t
        if lora:
            b[o:o + n], b[o + n:o + t] = slots, 0  # weight_indices
            o += t
        b[o:o + 4] = 0  # the placeholder's block table: the null block
        o += 4
        self._fill_table(o, seqs, n_dec, width)
        table = self.device_buf[o:o + n_dec * width].view(n_dec, width)
        o += n_dec * width
        b[o:o + n] = np.arange(n)  # logits_idx: every decoding sequence samples
        v = self._decode_views.get((rows, lora))
        if v is None:  # every column but the decode block table and logits_idx, whose lengths vary
            lengths = (t, t, t, n_dec, n_dec, 4, 4, t, t if lora else 0, 4)
            v = self._decode_views[(rows, lora)] = self._views(dict(zip(COLUMNS, lengths)), 2, 2)
        attn = AttentionMetadata(v["slot_mapping"], v["decode_token_idx"], v["decode_q_pos"], table,
                                 self.arange[:keys], v["prefill_token_idx"], v["prefill_q_pos"],
                                 v["prefill_block_table"], self.arange[:PLACEHOLDER_KEYS], v["out_idx"])
        return StepInputs(v["input_ids"], v["positions"], attn, LoRABatch(v["weight_indices"] if lora else None),
                          self.device_buf[o:o + n], seqs, len(adapters)), o + n

    def _views(self, lengths: dict[str, int], prefill_rows: int, decode_rows: int) -> dict[str, torch.Tensor]:
        """The device buffer cut into the columns of `lengths`, back to back; matrices as (rows, width)."""
        views, start = {}, 0
        for name, length in lengths.items():
            view = self.device_buf[start:start + length]
            if name in _MATRICES:
                view = view.view(decode_rows if name == "decode_block_table" else prefill_rows, -1)
            views[name] = view
            start += length
        return views

    def _build_general(self, single: list[Planned], chunks: list[Planned], merged: bool) -> StepInputs:
        bs = self.block_size
        n_single = len(single)
        n_tokens = n_single + sum(p.length for p in chunks) + 1  # + one dummy token for padding
        dummy = n_tokens - 1
        input_ids, positions, slot_mapping, lora_col = [], [], [], []
        for p in (*single, *chunks):
            table = p.seq.block_table
            input_ids += p.seq.tokens(p.start, p.start + p.length)
            positions += range(p.start, p.start + p.length)
            slot_mapping += [table[i // bs] * bs + i % bs for i in range(p.start, p.start + p.length)]
            lora_col += p.seq.slots(p.start, p.length)  # (an activated adapter's: 0 before its invocation)
        input_ids.append(0); positions.append(0); slot_mapping.append(0); lora_col.append(0)
        # Each token indexes the layers' stacked LoRA weights by its slot (0, the base model: zero rows).
        lora_slots = set(lora_col)

        dec_idx = list(range(n_single)) + [dummy] * max(0, 2 - n_single)
        dec_pos = [p.start for p in single] + [0] * max(0, 2 - n_single)
        dec_keys = max(2, max(dec_pos) + 1)
        rows = attention_rows(chunks)
        width = max([2] + [p.length for p in rows])
        n_rows = max(2, len(rows))
        pre_idx, pre_pos, out_idx = [], [], list(range(n_single))
        offset = n_single
        for row in range(n_rows):
            if row < len(rows):
                p = rows[row]
                pre_idx += list(range(offset, offset + p.length)) + [dummy] * (width - p.length)
                pre_pos += list(range(p.start, p.start + p.length)) + [0] * (width - p.length)
                out_idx += range(len(dec_idx) + row * width, len(dec_idx) + row * width + p.length)
                offset += p.length
            else:
                pre_idx += [dummy] * width
                pre_pos += [0] * width
        out_idx.append(0)
        # a real group reads more keys than the placeholder (forward_batch.PLACEHOLDER_KEYS)
        pre_keys = max(PLACEHOLDER_KEYS + 1, max(pre_pos) + 1) if chunks else PLACEHOLDER_KEYS
        dec_width, pre_width = table_width(dec_keys, bs), table_width(pre_keys, bs)
        weight_indices = lora_col if lora_slots != {0} and not merged else []  # merged: no LoRA work
        logits_idx, sampled = [], []
        prompt_idx, prompt_targets, prompt_rows = [], [], []  # rows after the sampled ones
        flat = 0
        for p in (*single, *chunks):
            if p.samples:
                logits_idx.append(flat + p.length - 1)
                sampled.append(p.seq)
            first, end = prompt_logprob_span(p.seq, p.start, p.length) if p.seq.prompt_logprobs_pending else (0, 0)
            if end > first:
                prompt_idx += range(flat + first - p.start, flat + end - p.start)
                prompt_targets += p.seq.prompt_ids[first + 1:end + 1]
                prompt_rows.append((p.seq, end - first))
            flat += p.length
        logits_idx += prompt_idx

        columns = dict(zip(COLUMNS, (input_ids, positions, slot_mapping, dec_idx, dec_pos, pre_idx, pre_pos,
                                     out_idx, weight_indices, None, None, logits_idx, prompt_targets)))
        lengths = {name: len(c) if c is not None else 0 for name, c in columns.items()}
        lengths["prefill_block_table"] = n_rows * pre_width
        lengths["decode_block_table"] = len(dec_idx) * dec_width
        total = sum(lengths.values())
        self._check(total)
        start = 0
        for name, c in columns.items():
            if name == "prefill_block_table":
                self._fill_table(start, [p.seq for p in rows], n_rows, pre_width)
            elif name == "decode_block_table":
                self._fill_table(start, [p.seq for p in single], len(dec_idx), dec_width)
            else:
                self.np[start:start + len(c)] = c
            start += lengths[name]
        self._copy(total)
        v = self._views(lengths, n_rows, len(dec_idx))
        attn = AttentionMetadata(
            slot_mapping=v["slot_mapping"],
            decode_token_idx=v["decode_token_idx"], decode_q_pos=v["decode_q_pos"],
            decode_block_table=v["decode_block_table"], decode_key_pos=self.arange[:dec_keys],
            prefill_token_idx=v["prefill_token_idx"], prefill_q_pos=v["prefill_q_pos"],
            prefill_block_table=v["prefill_block_table"], prefill_key_pos=self.arange[:pre_keys],
            out_idx=v["out_idx"],
        )
        lora = LoRABatch(weight_indices=v["weight_indices"] if weight_indices else None)
        return StepInputs(v["input_ids"], v["positions"], attn, lora, v["logits_idx"], sampled, len(lora_slots - {0}),
                          prompt_rows, v["prompt_targets"] if prompt_rows else None)
