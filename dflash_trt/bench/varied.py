"""The built-in `varied` prompt set: 24 prompts written for this project, 4 of each of 6 kinds, shipped as
Python (no download, no data file): `dflash-trt bench --dataset varied`.

  code-edit  code given in the prompt and a change asked for (the answer copies most of the prompt)
  sql        a query against a described schema
  shell      a shell one-liner or short script
  math       an arithmetic word problem, worked step by step
  advice     practical advice in a few paragraphs
  summary    a summary of a text given in the prompt

The kinds alternate (code-edit, sql, shell, math, advice, summary, code-edit, ...), so the first n
prompts are as varied as n allows; `PROMPTS` is that order.
"""

from __future__ import annotations

KINDS = ("code-edit", "sql", "shell", "math", "advice", "summary")

_CODE_EDIT = [
    "Rename the function `mean` to `average` everywhere and add a docstring. Reply with the whole file in one "
    "Python code block.\n\n```python\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef spread(values):\n    m = mean(values)\n"
    "    return max(values) - min(values), m\n\n\nif __name__ == '__main__':\n    print(mean([1, 2, 3]))\n"
    "    print(spread([4, 8, 15, 16, 23, 42]))\n```",
    "Add type hints to every function below and make `parse_line` raise ValueError on an empty line. Reply "
    "with the whole module in one Python code block.\n\n```python\nimport csv\n\n\ndef parse_line(line):\n"
    "    name, age, city = line.strip().split(',')\n    return {'name': name, 'age': int(age), 'city': city}\n\n\n"
    "def load(path):\n    with open(path) as f:\n        return [parse_line(line) for line in f if line.strip()]\n\n\n"
    "def adults(rows):\n    return [r for r in rows if r['age'] >= 18]\n```",
    "Convert this JavaScript to use `const`/`let` instead of `var` and arrow functions where possible. Reply "
    "with the whole code in one code block.\n\n```javascript\nvar items = [3, 1, 4, 1, 5, 9, 2, 6];\n\n"
    "function double(x) {\n  return x * 2;\n}\n\nfunction sum(list) {\n  var total = 0;\n"
    "  for (var i = 0; i < list.length; i++) {\n    total += list[i];\n  }\n  return total;\n}\n\n"
    "var doubled = items.map(function (x) { return double(x); });\nconsole.log(sum(doubled));\n```",
    "Change the class below so that `withdraw` refuses to overdraw the account (raise ValueError with a "
    "message) and add a `history` list that records every deposit and withdrawal. Reply with the whole class "
    "in one Python code block.\n\n```python\nclass Account:\n    def __init__(self, owner, balance=0):\n"
    "        self.owner = owner\n        self.balance = balance\n\n    def deposit(self, amount):\n"
    "        self.balance += amount\n        return self.balance\n\n    def withdraw(self, amount):\n"
    "        self.balance -= amount\n        return self.balance\n\n    def __repr__(self):\n"
    "        return f'Account({self.owner!r}, {self.balance})'\n```",
]

_SQL = [
    "Tables: customers(id, name, country), orders(id, customer_id, total, created_at). Write a SQL query "
    "that lists each country with its number of customers and the total value of their orders in 2024, "
    "highest total first.",
    "Table employees(id, name, department, salary, manager_id). Write a SQL query that returns every employee "
    "whose salary is above the average salary of their department, with that average.",
    "Tables: products(id, name, category), sales(product_id, quantity, sold_on). Write a SQL query for the three "
    "best-selling products by quantity in each category over the last 30 days, using a window function.",
    "Table events(user_id, event_type, happened_at). Write a SQL query that counts, per day, the users whose "
    "first ever event happened that day.",
]

_SHELL = [
    "Write a bash one-liner that finds the 10 largest files under the current directory (recursively) and "
    "prints their sizes in human-readable form.",
    "Write a shell script that renames every .jpeg file in a folder to .jpg, skipping files whose new name "
    "already exists, and prints what it did.",
    "Using standard Unix tools, count how many times each HTTP status code appears in an nginx access.log "
    "(the status is the 9th space-separated field), sorted by count.",
    "Write a bash loop that pings each host listed in hosts.txt once and prints 'up' or 'down' next to the "
    "host name.",
]

_MATH = [
    "A train leaves at 9:40 and travels 210 km at 84 km/h, then waits 15 minutes and travels another 96 km "
    "at 72 km/h. At what time does it arrive? Show your steps.",
    "A shop sells pencils at 3 for $1.20 and notebooks at $2.75 each. Maya buys 12 pencils and 4 notebooks "
    "and pays with a $20 bill. How much change does she get? Show your steps.",
    "A rectangular garden is 3 m longer than it is wide and its area is 108 square meters. A path 1 m wide "
    "runs around it. What is the area of the path? Show your steps.",
    "Tom reads 18 pages a day and his sister reads 25 pages a day. They start the same 430-page book on the "
    "same day. How many days after Tom's sister finishes does Tom finish? Show your steps.",
]

_ADVICE = [
    "I have a job interview for a junior data analyst position next week. How should I prepare?",
    "My houseplants keep getting yellow leaves. What are the most likely causes and what should I try?",
    "How can I make a small home office more comfortable for working eight hours a day?",
    "I want to start running but get bored quickly. How can I build a habit that lasts?",
]

_SUMMARY = [
    "Summarize the following text in three sentences.\n\nThe town council met on Tuesday to discuss the "
    "future of the old railway station. The building, closed since 1998, has been empty for over two decades "
    "and its roof is now leaking. One group of residents wants it turned into a library and community centre, "
    "arguing that the town has no public space large enough for events. Another group prefers selling it to a "
    "developer who has offered to build apartments while keeping the historic facade. The council's budget "
    "could cover the repairs only if the library project receives a regional grant, which would not be "
    "decided until next spring. The council voted to seal the roof this winter and postpone the final "
    "decision until the grant outcome is known.",
    "Summarize this email in two bullet points.\n\nHi all, a quick update on the website migration. The new "
    "hosting account is set up and the staging site is live at the usual address. We found that two of the "
    "contact forms lose their attachments on the new server; Priya is looking into it and expects a fix by "
    "Thursday. Because of that, we are moving the switch-over from this Friday to next Tuesday. Please keep "
    "making content changes on the old site until Monday evening; anything changed after that will have to "
    "be redone. Thanks, Sam",
    "Give a one-paragraph summary of this passage.\n\nHoneybees communicate the location of food through "
    "the waggle dance. A forager returning to the hive runs in a straight line while shaking her body, then "
    "circles back and repeats. The angle of the straight run relative to vertical tells the other bees the "
    "direction of the food relative to the sun, and the duration of the waggle tells them the distance. "
    "Bees watching the dance also smell the flowers on the dancer and taste the nectar she shares. Because "
    "the sun moves during the day, dancers adjust the angle over time, and recruits who fly out hours later "
    "still find the food.",
    "Summarize the key points of these meeting notes as a short list.\n\nProject Falcon weekly sync. "
    "Attendees: Ana, Ben, Chris, Dee. The prototype passed the load test at 2,000 requests per second, above "
    "the 1,500 target. Memory use is still 20% above budget; Ben will profile the cache layer. The design "
    "review is moved to the 14th because Dee is travelling. Chris raised that the logging format differs "
    "between services; the team agreed to adopt the JSON format from the billing service. Next milestone: "
    "the beta release at the end of the month, pending the memory fix.",
]

PROMPTS: list[tuple[str, str]] = [
    (f"{kind}-{i + 1}", group[i])
    for i in range(4)
    for kind, group in zip(KINDS, (_CODE_EDIT, _SQL, _SHELL, _MATH, _ADVICE, _SUMMARY))
]
