"""Who answers a turn for ``dflashkit regenerate``: the local target (``TargetGenerator``: the slot generator of
``generator.py`` for attention-only targets, Hugging Face ``generate`` for the others) or an OpenAI-compatible
server (``ServerGenerator``: vLLM, SGLang). Both render the conversation with the same chat code as extraction
and training and return the assistant's next turn as text."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dflashkit import launch
from dflashkit.errors import UserError, shown
from dflashkit.extract.data.rendering import BadSample, ChatConfig, prompt_ids
from dflashkit.targets.chat_template import stop_token_ids

Chunk = list[tuple[int, list[dict]]]  # conversations answered together: (record index, its turns)
EMPTY_ANSWER = "empty_answer"  # the skip reason of a conversation whose answer from a server came back empty


class EmptyAnswer(BadSample):
    """A server's answer with no text: the conversation is skipped and counted under ``EMPTY_ANSWER`` (a reason
    of regeneration's, not of the data's: --on-bad fail does not stop on it)."""

    def __init__(self, detail: str):
        super().__init__("empty_content", detail)
        self.reason = EMPTY_ANSWER


@dataclass
class AnswerSettings:
    """What every answer is asked with, by a local target or a server (regenerate's --max-new-tokens, sampling
    and --chat-template-kwargs; the defaults: greedy, no kwargs)."""

    max_new_tokens: int  # longest answer per turn
    template_kwargs: dict = field(default_factory=dict)  # the chat template's keyword arguments
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = 0  # 0: no top-k


class TargetGenerator:
    """Answers from a local target, turn by turn: the slot generator (static cache, continuous batching, CUDA
    graph) for attention-only targets, Hugging Face ``generate`` (left-padded batches) for the others."""

    def __init__(self, target: str, answers: AnswerSettings, *, batch_size: int, max_prompt_length: int | None = None,
                 dtype: str | None = None, device: str | None = None, cuda_graph: bool = True,
                 decode_attention: str = "triton", chat_template: str | None = None):
        """``target``: as for ``load_target``; ``batch_size``: sequences decoded at once (cache slots; HF
        ``generate``: per call); ``chat_template``: a template's text replacing the tokenizer's (None: its own)."""
        from dflashkit.targets.loading import load_target
        from dflashkit.targets.runtime.parts import attention_only

        from .generator import SlotGenerator

        device = str(launch.local_device(device))
        torch_dtype = launch.default_dtype(device, dtype)
        self.target = load_target(target, dtype=torch_dtype, device=device)
        self.tok = self.target.tokenizer
        self.cfg = ChatConfig(template_kwargs=answers.template_kwargs, chat_template=chat_template)  # as training
        self.stop_ids = list(stop_token_ids(self.tok, self.target.model.generation_config, self.cfg.chat_template,
                                            self.cfg.template_kwargs))  # the ones eval ends answers on
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop_ids[0]
        self.max_new_tokens, self.max_prompt_length, self.batch_size = (answers.max_new_tokens, max_prompt_length,
                                                                        batch_size)
        self.temperature, self.top_p, self.top_k = answers.temperature, answers.top_p, answers.top_k
        self.device = device
        self.name = self.target.path
        self.slots = None
        if attention_only(self.target):
            self.slots = SlotGenerator(self.target, self.stop_ids, num_slots=batch_size, temperature=self.temperature,
                                       top_p=self.top_p, top_k=self.top_k, cuda_graph=cuda_graph,
                                       decode_attention=decode_attention)

    def _prompt(self, history: list[dict]) -> list[int]:
        """Token ids that ask for the next assistant turn of `history` (BadSample if longer than allowed)."""
        prompt = prompt_ids(self.tok, history, self.cfg)
        if self.max_prompt_length is not None and len(prompt) > self.max_prompt_length:
            raise BadSample("too_long", f"a prompt of {len(prompt)} tokens > --max-prompt-length "
                                        f"{self.max_prompt_length}")
        return prompt

    def answer(self, histories: list[list[dict]], seed: int) -> list[str | BadSample]:
        """The target's next assistant turn for each history (a BadSample where the prompt cannot be made)."""
        out: list[str | BadSample] = []
        prompts = []
        for h in histories:
            try:
                prompts.append(self._prompt(h))
                out.append("")
            except BadSample as e:
                prompts.append(None)
                out.append(e)
        live = [k for k, p in enumerate(prompts) if p is not None]
        if self.slots is not None:
            new = self.slots.generate([prompts[k] for k in live], self.max_new_tokens, seed=seed)
        else:
            new = []
            for start in range(0, len(live), self.batch_size):
                new += self.hf_generate([prompts[k] for k in live[start:start + self.batch_size]], seed + start)
        for k, tokens in zip(live, new):
            out[k] = self.tok.decode(tokens, skip_special_tokens=True)
        return out

    def answer_turns(self, chunk: Chunk, seed: int, on_done=None) -> list[list[dict] | BadSample]:
        """Every user turn of each (index, turns) conversation answered in order, each answer joining the history
        of the next turn; per conversation its messages, or a BadSample when not even its first turn can be
        answered. A later turn whose prompt is longer than --max-prompt-length ends the conversation before it
        (``_Conversation.cut``). ``on_done(k, result)`` is called as soon as conversation ``k`` is complete.

        With the slot generator a conversation's next turn is queued the moment its previous answer ends
        (``follow_up``), so short and long conversations share the slots; with Hugging Face ``generate``
        the conversations advance together, one turn per round."""
        talks = [_Conversation(turns) for _, turns in chunk]
        done = on_done or (lambda k, result: None)
        if self.slots is None:
            return self._answer_in_rounds(talks, seed + chunk[0][0], done)
        feed = _TurnFeed(self, talks, done)
        first = [p for p in map(feed.ask, talks) if p is not None]
        while first:
            # the cache holds --max-prompt-length (without it: the longest prompt so far, at least 1024) plus the
            # answer; a later turn that outgrows it waits for the next round, whose cache is sized for it
            feed.cap = self.max_prompt_length or max(1024, max(map(len, first)))
            self.slots.generate(first, self.max_new_tokens, seed=seed + chunk[0][0], follow_up=feed.follow_up,
                                max_prompt_length=feed.cap)
            first = feed.next_round()
        return [t.result() for t in talks]

    def _answer_in_rounds(self, talks: list[_Conversation], seed: int, done) -> list[list[dict] | BadSample]:
        """Hugging Face ``generate``: every unfinished conversation's next turn in one round, until none is left."""
        while True:
            asking = []
            for k, t in enumerate(talks):
                if not t.finished:
                    if t.next_turn():
                        asking.append(t)
                    else:
                        done(k, t.result())
            if not asking:
                return [t.result() for t in talks]
            for t, text in zip(asking, self.answer([t.history for t in asking], seed)):
                t.answered(text)

    def hf_generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """New tokens per prompt from one Hugging Face ``generate`` call (left padding), cut before a stop id."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        kwargs: dict = {"do_sample": self.temperature > 0}
        if self.temperature > 0:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0: no top-k
        torch.manual_seed(seed)
        with torch.inference_mode():
            gen = self.target.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                             max_new_tokens=self.max_new_tokens, eos_token_id=self.stop_ids,
                                             pad_token_id=self.pad_id, **{k: v for k, v in kwargs.items()
                                                                          if v is not None})
        out = []
        for row in gen[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stop_ids), len(row))
            out.append(row[:cut])
        return out


class _Conversation:
    """A conversation being regenerated: its history so far and the turns still to come.

    A turn that cannot be answered (its prompt is too long) ends the conversation before it when an earlier turn
    was answered (``cut``: the history up to the last answer is kept), else the conversation is a BadSample."""

    def __init__(self, turns: list[dict]):
        self.turns, self.pos, self.history = turns, 0, []
        self.bad: BadSample | None = None
        self.cut = False  # ended early: a later turn could not be answered
        self.finished = False

    def next_turn(self) -> bool:
        """Move the turns up to the next user turn into the history; False when none is left (or it ended)."""
        if self.bad is not None or self.cut:
            self.finished = True
            return False
        while self.pos < len(self.turns) and self.turns[self.pos]["role"] != "user":
            self.history.append(self.turns[self.pos])
            self.pos += 1
        if self.pos == len(self.turns):
            self.finished = True
            return False
        self.history.append(self.turns[self.pos])
        self.pos += 1
        return True

    def answered(self, text: "str | BadSample") -> None:
        if not isinstance(text, BadSample):
            self.history.append({"role": "assistant", "content": text})
        elif any(m["role"] == "assistant" for m in self.history):
            while self.history[-1]["role"] != "assistant":  # drop the turn that could not be answered
                self.history.pop()
            self.cut = True
        else:
            self.bad = text

    def result(self) -> "list[dict] | BadSample":
        return self.bad if self.bad is not None else self.history


@dataclass
class _TurnFeed:
    """The slot generator's requests for one chunk of conversations: each request's conversation, and the prompts
    that outgrew this round's cache (they start the next round)."""

    gen: TargetGenerator  # renders the prompts, decodes the answers
    talks: list[_Conversation]  # the chunk's conversations
    done: Callable  # done(k, result): conversation k is complete
    cap: int = 1 << 62  # the longest prompt this round's cache holds (the first turns all fit the first round)
    owner: list[_Conversation] = field(default_factory=list)  # request -> its conversation
    waiting: list[tuple[_Conversation, list[int]]] = field(default_factory=list)  # prompts longer than cap
    position: dict[int, int] = field(init=False)  # id(conversation) -> its place in the chunk

    def __post_init__(self):
        self.position = {id(t): k for k, t in enumerate(self.talks)}

    def ask(self, talk: _Conversation) -> list[int] | None:
        """The prompt of the conversation's next turn (None: it is complete, or its prompt waits for a round)."""
        if talk.next_turn():
            try:
                prompt = self.gen._prompt(talk.history)
            except BadSample as e:
                talk.answered(e)
            else:
                if len(prompt) > self.cap:
                    self.waiting.append((talk, prompt))
                    return None
                self.owner.append(talk)
                return prompt
        self.done(self.position[id(talk)], talk.result())
        return None

    def follow_up(self, r: int, tokens: list[int]) -> list[int] | None:
        """SlotGenerator's ``follow_up``: request ``r``'s answer joins its conversation, whose next turn follows."""
        self.owner[r].answered(self.gen.tok.decode(tokens, skip_special_tokens=True))
        return self.ask(self.owner[r])

    def next_round(self) -> list[list[int]]:
        """The waiting prompts, which start the next round (its requests numbered from 0 again)."""
        self.owner[:] = [talk for talk, _ in self.waiting]
        first = [prompt for _, prompt in self.waiting]
        self.waiting.clear()
        return first


class ServerGenerator:
    """One chat-completions request per turn to an OpenAI-compatible server (vLLM, SGLang, ...)."""

    def __init__(self, server: str, model: str | None, answers: AnswerSettings, *, concurrency: int,
                 api_key: str = ""):
        """``concurrency``: requests in flight; ``api_key``: the bearer token (empty: none is sent)."""
        if not model:
            raise UserError("--server needs --model (the name the server serves the target under)")
        self.url = server.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.concurrency = model, api_key, concurrency
        self.max_new_tokens, self.temperature = answers.max_new_tokens, answers.temperature
        self.top_p, self.top_k = answers.top_p, answers.top_k
        self.template_kwargs, self.name = answers.template_kwargs, f"{server} {model}"

    def _post(self, body: dict) -> dict:
        """The reply's message to one request (``_reply``), with retries where the server may recover."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = None
        for attempt in range(4):
            req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    return self._reply(r.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code < 500 and e.code != 429:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = str(e)
            except http.client.HTTPException as e:  # the connection cut mid-reply (IncompleteRead, ...)
                last = f"the connection was cut in the middle of the reply ({type(e).__name__}: {shown(str(e))})"
            if attempt < 3:
                time.sleep(2 ** attempt)
        raise UserError(f"{self.url}: {last}; check --server and --model (run again with --resume)")

    def _reply(self, raw: bytes) -> dict:
        """The message of a chat-completions reply; UserError naming the URL for anything else (not JSON: not an
        OpenAI-compatible endpoint; an ``error`` object or no choices: the server refused the request)."""
        try:
            reply = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{self.url}: the answer is not JSON ({shown(raw[:200])}); give --server the base URL "
                            f"of an OpenAI-compatible API, ending in /v1 (e.g. http://localhost:8000/v1)") from None
        error = reply.get("error") if isinstance(reply, dict) else None
        if error:
            said = error.get("message", error) if isinstance(error, dict) else error
            raise UserError(f"{self.url}: the server answered with an error: {shown(said)}; check --model (the "
                            f"name the server serves) and the flags, then run again with --resume")
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and isinstance(choices[0].get("message"), dict)):
            raise UserError(f'{self.url}: expected {{"choices": [{{"message": ...}}]}}, got {shown(raw[:200])}; '
                            f"check --server and --model, then run again with --resume")
        return choices[0]["message"]

    def answer_turns(self, chunk: Chunk, seed: int, on_done=None) -> list[list[dict] | BadSample]:
        """Every user turn of each (index, turns) conversation answered in order (as TargetGenerator's); requests
        for --concurrency conversations in flight, each seeded with seed + its index; ``on_done(k, result)``
        as each conversation completes (from the request threads)."""
        def one(k):
            index, turns = chunk[k]
            talk = _Conversation(turns)
            try:
                while talk.next_turn():
                    talk.answered(self.answer_one(talk.history, seed + index))
                result = talk.result()
            except BadSample as e:
                result = e
            if on_done is not None:
                on_done(k, result)
            return result

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, range(len(chunk))))

    def answer_one(self, history: list[dict], seed: int) -> str:
        body = {"model": self.model, "messages": history, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": seed}
        if self.top_k:
            body["top_k"] = self.top_k
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        msg = self._post(body)
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not str(content).strip() and not reasoning:  # nothing to learn from: the conversation is skipped
            raise EmptyAnswer(f"the server's answer to user turn {sum(m['role'] == 'user' for m in history)} is "
                              f"empty")
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}" if reasoning else content
