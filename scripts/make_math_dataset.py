"""Writes data/arithmetic.jsonl: small arithmetic word problems with numeric solutions (deterministic)."""

import json
import random

rng = random.Random(20261129)
rows = []
templates = [
    ("What is {a} + {b}?", lambda a, b: a + b),
    ("What is {a} - {b}?", lambda a, b: a - b),
    ("What is {a} times {b}?", lambda a, b: a * b),
    ("Tom has {a} apples and buys {b} more. How many apples does he have?", lambda a, b: a + b),
    ("A box holds {a} pens. {b} pens are taken out. How many pens are left?", lambda a, b: a - b),
]
seen = set()
while len(rows) < 400:
    text, solve = rng.choice(templates)
    a, b = rng.randint(2, 30), rng.randint(1, 20)
    if "times" in text:
        a, b = rng.randint(2, 12), rng.randint(2, 9)
    if solve(a, b) < 0:
        a, b = b + a, a
    question = text.format(a=a, b=b)
    if question in seen:
        continue
    seen.add(question)
    rows.append(
        {
            "prompt": [{"role": "user", "content": question + " Answer with just the number."}],
            "solution": str(solve(a, b)),
        }
    )
with open("data/arithmetic.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
print(len(rows), "rows")
