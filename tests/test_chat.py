"""Multi-turn chat (spinquant_et/chat.py and `spinquant-et chat`): the template pieces render what
apply_chat_template renders, a new turn continues the KV cache (only its tokens are prefilled, and its
logits equal one prefill of the whole conversation), a full context drops the oldest turns, and a turn
that cannot fit gets one error line while the chat goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_CHAT_TEMPLATE, TINY_MAX_SEQ
from tiny import TINY_VOCAB

from spinquant_et.chat import ChatSession, ChatTemplate, ContextFull
from spinquant_et.errors import SpinQuantError
from spinquant_et.runtime import PteModel
from spinquant_et.sampling import SamplingConfig

ROOT = Path(__file__).parents[1]
QWEN_LIKE = (  # no default system prompt; a system message comes first when given
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
REWRITES_HISTORY = (  # keeps only the last user message: turns do not append
    "{{ '<s>' }}{% for m in messages %}{% if loop.last %}[user] {{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _tokenizer(tiny_tokenizer, template):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, QWEN_LIKE])
def test_template_pieces_render_what_apply_chat_template_renders(tiny_tokenizer, template):
    tok = _tokenizer(tiny_tokenizer, template)
    t = ChatTemplate.from_tokenizer(tok)
    convo = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "And then?"}]
    expect = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert t.first_turn("hi there") + "Hello!" + t.next_turn("And then?") == expect
    with_system = [{"role": "system", "content": "You are terse."}, *convo]
    expect = tok.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False)
    assert t.first_turn("hi there", system="You are terse.") + "Hello!" + t.next_turn("And then?") == expect


def test_templates_without_a_system_role_or_that_rewrite_turns_say_so(tiny_tokenizer, tmp_path):
    t = ChatTemplate.from_tokenizer(_tokenizer(tiny_tokenizer, NO_SYSTEM_ROLE))
    assert t.turn_prefix is not None and t.system_prefix is None
    with pytest.raises(SpinQuantError, match="no system role; drop --system"):
        t.header("be nice")
    t = ChatTemplate.from_tokenizer(_tokenizer(tiny_tokenizer, REWRITES_HISTORY))
    assert t.turn_prefix is None and t.prefix == "<s>[user] "
    with pytest.raises(SpinQuantError, match="does not append turns"):
        t.next_turn("again")
    t.write(tmp_path / "chat.json")  # what the C++ runner reads: no turn_prefix key at all
    assert ChatTemplate.from_file(tmp_path / "chat.json") == t
    assert "turn_prefix" not in (tmp_path / "chat.json").read_text()


def test_a_later_prefill_continues_the_cache_exactly(tiny_pte):
    """Prompt, 6 decode steps (forward_near), then 9 new tokens at once at position 14 (spill_near,
    forward_ctx): the logits equal those of one prefill of all 23 tokens. Both paths quantize the same
    per-token activations, so they agree to float rounding."""
    ids = [int(i) for i in torch.randint(1, TINY_VOCAB, (23,), generator=torch.Generator().manual_seed(0))]
    m = PteModel(tiny_pte)
    m.forward(ids[:8], 0)
    for pos in range(8, 14):
        m.forward([ids[pos]], pos)
    continued = m.forward(ids[14:], 14).clone()
    whole = PteModel(tiny_pte).forward(ids, 0)
    assert torch.allclose(continued, whole, rtol=1e-4, atol=1e-4), (continued - whole).abs().max()


def _session(pte, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(pte).parent)
    template = ChatTemplate.from_file(Path(pte).parent / "chat.json")
    notices: list[str] = []
    session = ChatSession(PteModel(pte), lambda s: tok.encode(s, add_special_tokens=False), template,
                          on_notice=notices.append, **kw)
    return session, tok, template, notices


def test_each_turn_prefills_only_its_own_tokens(tiny_chat_pte):
    session, tok, template, notices = _session(tiny_chat_pte, max_new_tokens=6)
    first = session.turn("hello")
    assert first.prefill_tokens == len(tok.encode(template.first_turn("hello"), add_special_tokens=False))
    second = session.turn("and more")
    expect = len(tok.encode(template.next_turn("and more"), add_special_tokens=False))
    # + the last reply token when the reply stopped at --max-new-tokens (it was sampled, never fed)
    assert second.prefill_tokens == expect + (len(first.reply) == 6)
    assert session.context == (tok.encode(template.first_turn("hello"), add_special_tokens=False) + first.reply
                               + tok.encode(template.next_turn("and more"), add_special_tokens=False) + second.reply)
    assert not notices and second.dropped_turns == 0


def test_a_full_context_drops_the_oldest_turns_and_goes_on(tiny_chat_pte):
    session, tok, template, notices = _session(tiny_chat_pte, max_new_tokens=8,
                                               sampling=SamplingConfig(temperature=0.9, seed=1))
    for i in range(12):
        session.turn(f"question number {i} about the data model")
        assert session.filled <= TINY_MAX_SEQ and len(session.context) <= TINY_MAX_SEQ
    assert notices and all("dropped the oldest" in n for n in notices), notices
    kept = [t.user for t in session.turns]
    assert kept == [f"question number {i} about the data model" for i in range(12 - len(kept), 12)]
    # after a drop the cache was refilled from position 0 with what is kept: the next turn continues it
    rebuilt = session._rebuild(session.turns[:-1], session.turns[-1].user) + session.turns[-1].reply
    assert session.context == rebuilt


def test_a_turn_longer_than_the_context_is_refused_and_the_chat_goes_on(tiny_chat_pte):
    session, *_ = _session(tiny_chat_pte, max_new_tokens=4)
    session.turn("hi")
    before = list(session.context)
    with pytest.raises(SpinQuantError, match="shorten it") as e:
        session.turn("word " * 200)
    assert "\n" not in str(e.value)
    assert session.context == before
    assert session.turn("hi again").reply is not None


def test_stop_when_full_ends_the_chat(tiny_chat_pte):
    session, *_ = _session(tiny_chat_pte, max_new_tokens=8, stop_when_full=True)
    with pytest.raises(ContextFull):
        for i in range(20):
            session.turn(f"question number {i} about the data model")


def _chat_cli(pte, stdin: str, *flags) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "spinquant_et.cli", "chat", str(pte), *flags], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def test_chat_cli_reads_turns_from_a_pipe(tiny_chat_pte):
    """`spinquant-et chat` as a user pipes it: a stats line per turn, /reset, a too-long turn's one error line,
    the context-full notice, and exit 0 at the end of input."""
    turns = ["hello", "/reset", "word " * 200, *[f"question {i} about the model" for i in range(8)], "/exit", "never"]
    r = _chat_cli(tiny_chat_pte, "\n".join(turns) + "\n", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    stats = [line for line in err if line.startswith("prefill ")]
    assert len(stats) == 9, r.stderr  # hello + 8 questions; not the refused turn, not after /exit
    assert any(line == "note: conversation reset" for line in err)
    assert [line for line in err if line.startswith("error:")] == [next(x for x in err if "shorten it" in x)]
    assert any("dropped the oldest" in line for line in err), r.stderr
