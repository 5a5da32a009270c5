import json, sys, re, collections
d = json.load(open(sys.argv[1]))
agg = collections.defaultdict(lambda: [0, 0.0])
for r in d["per_prompt"]:
    kind = re.sub(r"-\d+$", "", r["prompt"])
    for key in ((r["dataset"], kind), (r["dataset"], "ALL")):
        a = agg[key + (r["method"],)]
        a[0] += r["output_tokens"]; a[1] += r["wall_s"]
keys = sorted({k[:2] for k in agg})
print("| set | kind | baseline | dflash | ngram | hybrid | hybrid / max(ngram, dflash) | hybrid / baseline |")
print("|---|---|---|---|---|---|---|---|")
for ds, kind in keys:
    tps = {m: agg[(ds, kind, m)][0] / agg[(ds, kind, m)][1] for m in ("baseline", "dflash", "ngram", "hybrid") if agg[(ds, kind, m)][1]}
    best = max(tps["ngram"], tps["dflash"])
    print(f"| {ds} | {kind} | " + " | ".join(f"{tps[m]:.1f}" for m in ("baseline", "dflash", "ngram", "hybrid"))
          + f" | {tps['hybrid']/best:.3f} | {tps['hybrid']/tps['baseline']:.3f} |")
print("mismatches:", d.get("mismatches"), "other_cpu_share:", d.get("other_cpu_share"))
