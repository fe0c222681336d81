"""make_replay.py -- an agent-like conversation to replay for speculative decoding (docs/spec.md).

Usage: python3 bench/make_replay.py [--turns N] [--prompts FILE]
(N default 24; writes bench/replay/agent_turns.jsonl, and the serving prompts to FILE when given)

An agent edits a small project: the user (and the tools) hand it a file or a tool's output, and
every later turn quotes an earlier file or output back with a small edit (a renamed variable, a
changed constant, a new line, a test log with one more failure), as agent loops do.

agent_turns.jsonl: one turn a line, {"user": TEXT, "prefix": TEXT} for `k3 bench spec --replay`:
the model's own reply to each turn is generated (greedily) after PREFIX and kept in the
conversation, and PREFIX opens the quoted block the reply should reproduce.

the prompts FILE: one line a turn, {"prompt": TEXT}: the conversation up to that turn with the
scripted replies (the edited file as an agent would write it), for `k3 bench serve --dataset-name
custom --dataset-path FILE` (vLLM's custom dataset).
"""
import json
import os
import sys

ARGS = sys.argv[1:]
TURNS = int(ARGS[ARGS.index("--turns") + 1]) if "--turns" in ARGS else 24
PROMPTS = ARGS[ARGS.index("--prompts") + 1] if "--prompts" in ARGS else None
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay")

MODULE = """RATE = 0.05
LIMIT = 100

def interest(principal, years):
    total = principal
    for year in range(years):
        total = total * (1 + RATE)
    return total

def capped(value):
    if value > LIMIT:
        return LIMIT
    return value

def report(principal, years):
    return "%.2f" % capped(interest(principal, years))
"""

CONFIG = """[server]
host = 127.0.0.1
port = 8080
workers = 4
timeout = 30

[cache]
size = 512
policy = lru
"""

LOG = """collected 6 items
test_bank.py::test_interest PASSED
test_bank.py::test_capped PASSED
test_bank.py::test_report FAILED
test_bank.py::test_negative PASSED
test_bank.py::test_large FAILED
AssertionError: '100.00' != '110.25'
2 failed, 4 passed in 0.12s
"""

# the edits, in order: (which text, old, new, what the user says)
EDITS = [
    ("module", "LIMIT = 100", "LIMIT = 1000", "The cap is too low: make LIMIT 1000 and show me the whole file."),
    ("log", "2 failed, 4 passed", "1 failed, 5 passed", "I ran the tests again. Here is the output; what is left?"),
    ("module", "RATE = 0.05", "RATE = 0.04", "Change the rate to 0.04 and give the file back."),
    ("config", "port = 8080", "port = 9090", "Move the server to port 9090; show the config."),
    ("module", "for year in range(years):", "for _ in range(years):", "The loop variable is unused; rename it."),
    ("log", "test_bank.py::test_large FAILED", "test_bank.py::test_large PASSED", "Tests again:"),
    ("config", "workers = 4", "workers = 8", "Use 8 workers. The whole config please."),
    ("module", "    return value\n", "    return max(value, 0)\n", "Clamp negative values to zero too."),
    ("config", "size = 512", "size = 2048", "Bigger cache: 2048. Show the file."),
    ("module", "def report(principal, years):", "def report(principal, years, rate=RATE):",
     "Let report take the rate as an argument."),
    ("log", "collected 6 items", "collected 7 items", "I added a test; here is the run."),
    ("config", "timeout = 30", "timeout = 60", "Double the timeout."),
]


def apply(texts, which, old, new):
    assert old in texts[which], (which, old)
    texts[which] = texts[which].replace(old, new, 1)


def main():
    texts = {"module": MODULE, "config": CONFIG, "log": LOG}
    names = {"module": "bank.py", "config": "server.ini", "log": "the test run"}
    turns, scripted = [], []
    # the opening turns hand over the files and the first tool output
    for which in ["module", "config", "log"]:
        user = f"Here is {names[which]}:\n```\n{texts[which]}```\nRead it and repeat it back exactly."
        first = texts[which].splitlines()[0]
        turns.append({"user": user, "prefix": f"Here is {names[which]}:\n```\n{first}\n"})
        scripted.append((user, f"Here is {names[which]}:\n```\n{texts[which]}```"))
    i = 0
    while len(turns) < TURNS:
        which, old, new, ask = EDITS[i % len(EDITS)]
        i += 1
        if i > len(EDITS):  # second round: edit back and forth so every turn changes something
            old, new = new, old
            if old not in texts[which]:
                continue
        apply(texts, which, old, new)
        if which == "log":
            user = f"{ask}\n```\n{texts[which]}```"
            reply = f"The run says:\n```\n{texts[which]}```"
        else:
            user = ask
            reply = f"Here is {names[which]} with the change:\n```\n{texts[which]}```"
        first = reply.split("```\n")[0] + "```\n" + texts[which].splitlines()[0] + "\n"
        turns.append({"user": user, "prefix": first})
        scripted.append((user, reply))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "agent_turns.jsonl"), "w") as f:
        for t in turns:
            f.write(json.dumps(t) + "\n")
    if PROMPTS:
        with open(PROMPTS, "w") as f:
            conv = ""
            for user, reply in scripted:
                conv += f"User: {user}\nAssistant: "
                f.write(json.dumps({"prompt": conv}) + "\n")
                conv += reply + "\n"
    print(f"{len(turns)} turns: {OUT}/agent_turns.jsonl" + (f", prompts {PROMPTS}" if PROMPTS else ""))


if __name__ == "__main__":
    main()
