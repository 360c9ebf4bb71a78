"""Multi-turn chat on a ``.pte``: the chat template as literal pieces, and a conversation that lives in
the program's KV cache.

A runner without a Jinja engine (the C++ one) cannot render a tokenizer's chat template, so ``export``
renders it once around placeholder messages and writes the literal text between them to ``chat.json``:

    prefix         before the first user message, with the template's own default system prompt
    suffix         after a user message: the generation prompt the reply follows
    turn_prefix    after a reply, before the next user message (closes the reply: its end-of-turn token)
    system_prefix, system_suffix   around a system prompt given with --system (absent when the template
                   has no system role)

A conversation is then ``prefix + user1 + suffix + reply1 + turn_prefix + user2 + suffix + reply2 ...``,
exactly what ``apply_chat_template`` renders (tested), and each new turn only appends tokens: the
earlier ones stay in the KV cache and only ``turn_prefix + user + suffix`` is prefilled. When a turn does
not fit, the oldest turns are dropped and the rest is prefilled again from position 0 (or, with
``stop_when_full``, the chat ends). The C++ runner (``runner/src/main.cpp``) does the same.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .errors import SpinQuantError
from .sampling import SamplingConfig, SplitMix64, sample_token

log = logging.getLogger(__name__)

CHAT_FILE = "chat.json"
_USER1, _REPLY1, _USER2, _SYSTEM = "\x00USER1\x00", "\x00REPLY1\x00", "\x00USER2\x00", "\x00SYSTEM\x00"


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template as the literal text around messages (see the module docstring)."""

    prefix: str
    suffix: str
    turn_prefix: str | None = None
    system_prefix: str | None = None
    system_suffix: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatTemplate | None:
        """Render ``tokenizer``'s chat template around placeholders; None without a template, or where
        it does not wrap one user message in literal text. ``turn_prefix`` stays None where a second
        turn does not just append to the first (the template rewrites earlier turns)."""
        if not getattr(tokenizer, "chat_template", None):
            return None

        def render(messages) -> str | None:
            try:
                return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception:  # a template that refuses a role (no system role) or an order
                return None

        one = render([{"role": "user", "content": _USER1}])
        if one is None or one.count(_USER1) != 1:
            return None
        prefix, suffix = one.split(_USER1)
        turn_prefix = None
        two = render([{"role": "user", "content": _USER1}, {"role": "assistant", "content": _REPLY1},
                      {"role": "user", "content": _USER2}])
        if two and all(two.count(p) == 1 for p in (_USER1, _REPLY1, _USER2)):
            head, rest = two.split(_USER1)
            between, rest = rest.split(_REPLY1)
            turn, tail = rest.split(_USER2)
            if head == prefix and between == suffix and tail == suffix:
                turn_prefix = turn
        system_prefix = system_suffix = None
        with_system = render([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER1}])
        if with_system and with_system.count(_SYSTEM) == 1 and with_system.count(_USER1) == 1:
            before, rest = with_system.split(_SYSTEM)
            if _USER1 not in before:
                middle, tail = rest.split(_USER1)
                if tail == suffix:
                    system_prefix, system_suffix = before, middle
        return cls(prefix, suffix, turn_prefix, system_prefix, system_suffix)

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        data = json.loads(Path(path).read_text())
        keys = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in keys})

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({k: v for k, v in asdict(self).items() if v is not None}, indent=2))

    def header(self, system: str | None) -> str:
        """The text before the first user message."""
        if system is None:
            return self.prefix
        if self.system_prefix is None:
            raise SpinQuantError("this model's chat template has no system role; drop --system")
        return self.system_prefix + system + self.system_suffix

    def first_turn(self, user: str, system: str | None = None) -> str:
        return self.header(system) + user + self.suffix

    def next_turn(self, user: str) -> str:
        if self.turn_prefix is None:
            raise SpinQuantError("this model's chat template does not append turns (it rewrites earlier ones); "
                                 "chat one turn at a time with `generate --chat`")
        return self.turn_prefix + user + self.suffix


@dataclass
class Turn:
    user: str
    reply: list[int] = field(default_factory=list)  # the reply's tokens, without its end-of-turn token


@dataclass
class TurnResult:
    reply: list[int]
    prefill_tokens: int
    prefill_s: float
    decode_s: float
    dropped_turns: int = 0  # older turns dropped to make room for this one
    context_full: bool = False  # the reply stopped at the end of the context

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float:
        steps = len(self.reply) - 1  # the first token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s else float("nan")


class ContextFull(SpinQuantError):
    """The conversation does not fit the program's context and ``stop_when_full`` is set."""


class ChatSession:
    """A conversation with a loaded program (``runtime.PteModel``): ``turn(text)`` returns the reply's
    tokens; the conversation stays in the KV cache between turns.

    Each turn needs room for its prompt and ``reply_room`` tokens of reply (``max_new_tokens``, at most a
    quarter of the context). A turn that does not fit drops the oldest turns (``on_notice`` says so) and
    prefills the rest again; a turn that cannot fit even alone raises ``SpinQuantError`` and leaves the
    conversation as it was.
    """

    def __init__(self, model, encode: Callable[[str], list[int]], template: ChatTemplate,
                 system: str | None = None, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
                 stop_when_full: bool = False, on_notice: Callable[[str], None] | None = None):
        self.model, self.encode, self.template, self.system = model, encode, template, system
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or SamplingConfig()
        self.rng = SplitMix64(self.sampling.seed)
        self.stop_when_full = stop_when_full
        self.on_notice = on_notice or (lambda message: log.warning("%s", message))
        self.reply_room = max(1, min(max_new_tokens, model.max_seq_len // 4))
        template.header(system)  # a --system the template cannot take fails now, not at the first turn
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache is overwritten from position 0 at the next turn)."""
        self.turns: list[Turn] = []
        self.context: list[int] = []  # the conversation's token ids
        self.filled = 0  # how many of them the KV cache holds (the last reply token may not be in it yet)

    def _rebuild(self, turns: list[Turn], user: str) -> list[int]:
        """The token ids of ``turns`` and a new user message, from the start of the conversation."""
        ids = self.encode(self.template.first_turn(turns[0].user if turns else user, self.system))
        for i, turn in enumerate(turns):
            ids += turn.reply
            ids += self.encode(self.template.next_turn(turns[i + 1].user if i + 1 < len(turns) else user))
        return ids

    def turn(self, user: str, on_token: Callable[[int], None] | None = None) -> TurnResult:
        limit = self.model.max_seq_len
        if self.turns:
            new = self.encode(self.template.next_turn(user))
            context, start = self.context + new, self.filled
        else:
            context, start = self._rebuild([], user), 0
        dropped = 0
        if len(context) + self.reply_room > limit:
            if self.turns and self.stop_when_full:
                raise ContextFull(f"the conversation fills the program's context of {limit} tokens")
            for dropped in range(1, len(self.turns) + 1):  # the fewest oldest turns whose drop makes room
                context = self._rebuild(self.turns[dropped:], user)
                if len(context) + self.reply_room <= limit:
                    break
            start = 0  # with no earlier turn, context is already the first turn's ids
            if len(context) >= limit:
                raise SpinQuantError(f"this turn has {len(context)} tokens with the chat template but the program's "
                                     f"context is {limit}; shorten it (the conversation goes on without it)")
            if dropped:
                self.on_notice(f"context full ({limit} tokens): dropped the oldest {dropped} turn(s); "
                               f"prefilling the remaining {len(context)} tokens again")
        turns = self.turns[dropped:] + [Turn(user)]
        t0 = time.perf_counter()
        logits = self.model.forward(context[start:], start)
        prefill_s = time.perf_counter() - t0
        prefilled = len(context) - start
        pos = len(context)
        reply: list[int] = []
        t1 = time.perf_counter()
        full = False
        history = list(context) if self.sampling.repeat_penalty != 1.0 else None  # what the penalty looks back on
        while True:
            token = sample_token(logits, self.sampling, self.rng, history or ())
            if token in self.model.eos_ids:
                break
            reply.append(token)
            if history is not None:
                history.append(token)
            if on_token:
                on_token(token)
            if len(reply) >= self.max_new_tokens:
                break
            if pos >= limit:  # no position left to feed it
                full = True
                self.on_notice(f"the reply reached the end of the program's context ({limit} tokens)")
                break
            logits = self.model.forward([token], pos)
            pos += 1
        decode_s = time.perf_counter() - t1
        turns[-1].reply = reply
        self.turns = turns
        self.context = context + reply
        self.filled = pos
        return TurnResult(reply, prefilled, prefill_s, decode_s, dropped, full)
