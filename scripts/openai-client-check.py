#!/usr/bin/env python3
"""Drive a tandem coordinator with the official `openai` client and print
what came back, as one JSON object on stdout.

Used by tandem/tests/up.rs (which compares the greedy texts with the
single-process engine) and handy by hand:

    python scripts/openai-client-check.py --base-url http://127.0.0.1:8000/v1

Chat and completions, streaming and not, with usage; all greedy
(temperature 0). Any client exception exits non-zero with its message.
"""
import argparse
import json
import sys

from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"


def streamed(chunks, pick):
    text, usage, finish = [], None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage.model_dump()
        for choice in c.choices:
            piece = pick(choice)
            if piece:
                text.append(piece)
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(text), usage, finish


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    out = {"models": [m.id for m in client.models.list().data]}
    msgs = [{"role": "user", "content": QUESTION}]

    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=a.max_tokens, temperature=0)
    out["chat"] = {"text": r.choices[0].message.content, "usage": r.usage.model_dump(),
                   "finish": r.choices[0].finish_reason}

    s = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=a.max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, usage, finish = streamed(s, lambda ch: ch.delta.content)
    out["chat_stream"] = {"text": text, "usage": usage, "finish": finish}

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=a.max_tokens, temperature=0)
    out["completion"] = {"text": r.choices[0].text, "usage": r.usage.model_dump(),
                         "finish": r.choices[0].finish_reason}

    s = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=a.max_tokens, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    text, usage, finish = streamed(s, lambda ch: ch.text)
    out["completion_stream"] = {"text": text, "usage": usage, "finish": finish}
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
