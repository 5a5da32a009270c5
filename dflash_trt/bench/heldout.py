"""The built-in `heldout` prompt set: 20 prompts written for issue #42's hybrid measurement, 5 of each of 4
kinds, outside every training and bench set (not HumanEval, WritingBench or `varied`), shipped as Python:
`dflash-trt bench --dataset heldout`.

  code-edit  code given in the prompt and a change asked for (the answer copies most of the prompt)
  math       an arithmetic or algebra word problem, worked step by step
  chat       an open conversational question (little to copy, little a small drafter knows)
  summary    a summary of a text given in the prompt (some copying of names and phrases)

The kinds alternate (code-edit, math, chat, summary, code-edit, ...), so the first n prompts are as varied
as n allows; `PROMPTS` is that order. The prompt id's prefix is its kind (per-kind tables group by it).
"""

from __future__ import annotations

KINDS = ("code-edit", "math", "chat", "summary")

_CODE_EDIT = [
    "Add type hints to every function below and make `slugify` collapse repeated dashes. Reply with the whole "
    "file in one Python code block.\n\n```python\nimport re\n\n\ndef slugify(title):\n    title = title.lower()\n"
    "    title = re.sub(r'[^a-z0-9]+', '-', title)\n    return title.strip('-')\n\n\ndef unique_slug(title, taken):\n"
    "    base = slugify(title)\n    slug = base\n    n = 2\n    while slug in taken:\n        slug = f'{base}-{n}'\n"
    "        n += 1\n    return slug\n```",
    "Change `Inventory.remove` so that it raises KeyError with a clear message when the item is missing, and "
    "add a `total_value` method. Reply with the whole class in one Python code block.\n\n```python\n"
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, qty, price):\n"
    "        count, _ = self.items.get(name, (0, price))\n        self.items[name] = (count + qty, price)\n\n"
    "    def remove(self, name, qty):\n        count, price = self.items[name]\n"
    "        self.items[name] = (count - qty, price)\n\n    def count(self, name):\n"
    "        return self.items.get(name, (0, 0))[0]\n```",
    "Rewrite this JavaScript function to use `const`/`let` and arrow functions, keeping its behaviour. Reply "
    "with the whole code in one code block.\n\n```javascript\nfunction groupBy(list, key) {\n  var out = {};\n"
    "  for (var i = 0; i < list.length; i++) {\n    var k = list[i][key];\n    if (!out[k]) {\n      out[k] = [];\n"
    "    }\n    out[k].push(list[i]);\n  }\n  return out;\n}\n\nfunction countBy(list, key) {\n  var groups = "
    "groupBy(list, key);\n  var counts = {};\n  for (var k in groups) {\n    counts[k] = groups[k].length;\n  }\n"
    "  return counts;\n}\n```",
    "Fix the off-by-one error in `window_sums` and add a docstring to both functions. Reply with the whole file "
    "in one Python code block.\n\n```python\ndef window_sums(values, size):\n    sums = []\n"
    "    for start in range(len(values) - size):\n        sums.append(sum(values[start:start + size]))\n"
    "    return sums\n\n\ndef best_window(values, size):\n    sums = window_sums(values, size)\n"
    "    best = max(sums)\n    return sums.index(best), best\n```",
    "Convert this loop-based function into one that uses a dictionary comprehension, and rename `d` to "
    "`scores`. Reply with the whole file in one Python code block.\n\n```python\ndef grade(d):\n    out = {}\n"
    "    for name in d:\n        s = d[name]\n        if s >= 90:\n            out[name] = 'A'\n        elif s >= 80:\n"
    "            out[name] = 'B'\n        elif s >= 70:\n            out[name] = 'C'\n        else:\n"
    "            out[name] = 'F'\n    return out\n```",
]

_MATH = [
    "A bakery sells muffins for $2.50 each and cookies for $1.20 each. On Saturday it sold 84 muffins and 150 "
    "cookies. How much money did it take in? Show your working step by step.",
    "A train leaves at 9:40 and travels 210 km at an average speed of 84 km/h. At what time does it arrive? "
    "Explain each step.",
    "The sum of two numbers is 47 and their difference is 13. What are the numbers? Solve it step by step.",
    "A rectangular garden is 3 metres longer than it is wide, and its perimeter is 38 metres. What is its area? "
    "Work it out step by step.",
    "A shirt costs $40. It is discounted by 25%, and then a further 10% is taken off the discounted price. What "
    "is the final price, and what single percentage discount would give the same price? Show your steps.",
]

_CHAT = [
    "I just moved to a new city and don't know anyone. How can I start making friends as an adult?",
    "What are some good ways to stay focused when working from home?",
    "My friend keeps cancelling plans at the last minute. How should I bring it up without starting a fight?",
    "Can you suggest a few easy vegetarian dinners I could cook on a busy weeknight?",
    "I want to start running but I get bored quickly. Any tips to make it more enjoyable?",
]

_SUMMARY = [
    "Summarize this email in two sentences.\n\nHi all, the quarterly planning meeting has moved from Monday "
    "the 3rd to Wednesday the 5th at 10:00 in room 4B, because the finance team cannot attend on Monday. Please "
    "send your draft budgets to Laura by Tuesday noon so she can merge them before the meeting. If you cannot "
    "attend, send a deputy who can speak to your numbers. Lunch will be provided. Thanks, Omar",
    "Give a short summary of this passage.\n\nThe city library started lending tools in 2019: drills, ladders, "
    "sewing machines and garden equipment. Borrowers sign up with a library card and can keep a tool for a "
    "week. In the first year the collection grew from 40 to 310 items, mostly through donations, and the most "
    "borrowed item was a carpet cleaner. Staff say the program brings in people who had not visited the "
    "library in years, and two other branches plan to copy it next spring.",
    "Summarize the main points of this product review as a short list.\n\nI have used the Trailmate 40 backpack "
    "for three months of weekend hikes. The hip belt is comfortable and carries most of the weight, and the "
    "side pockets fit a one-litre bottle. The rain cover is built in, which I love. On the downside, the top "
    "zip is stiff, the back panel gets sweaty on hot days, and at 1.6 kg it is heavier than similar packs. "
    "For the price it is still a solid choice.",
    "Summarize this incident report in one paragraph.\n\nAt 14:05 on Tuesday the checkout service began "
    "returning errors for about 30% of requests. The on-call engineer traced it to a database connection pool "
    "that had been reduced from 50 to 5 connections in a configuration change deployed at 13:50. The change "
    "was rolled back at 14:32 and errors stopped by 14:35. No payments were lost; 212 customers saw an error "
    "page. Follow-ups: add a check that rejects pool sizes below 20, and alert on error rates above 5%.",
    "Write a two-sentence summary of this story.\n\nMara found an old key taped under the drawer of the desk "
    "she had bought at a flea market. For weeks she tried it in every lock she could find, from the shed to "
    "her neighbour's bicycle. Finally, clearing out her grandmother's attic, she noticed a small tin box with "
    "a keyhole. The key turned easily, and inside were letters her grandmother had written but never sent.",
]

PROMPTS: list[tuple[str, str]] = [
    (f"{kind}-{i + 1}", group[i]) for i in range(5) for kind, group in zip(KINDS, (_CODE_EDIT, _MATH, _CHAT, _SUMMARY))
]
