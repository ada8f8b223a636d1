"""Issue 34's check that the move changed nothing: per-test outcomes of two pytest junit files (ids and skip reasons
with harness/<room>/ read as harness/), and two `selftest --quick --json` kill matrices cell by cell.
  python compare_move.py junit BEFORE.xml AFTER.xml
  python compare_move.py selftest BEFORE.json AFTER.json"""
import json
import re
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        status = "pass"
        for child in tc:
            if child.tag in ("failure", "error"):
                status = "fail"
            elif child.tag == "skipped":
                status = "skip: " + re.sub(r"harness/\w+/", "harness/", child.get("message") or "")
        out[tc.get("classname") + "::" + tc.get("name")] = status
    return out


def cells(path):
    d = json.load(open(path))
    return {(m, det): (c["caught"], c["row"], c["named"], c["expected"])
            for m, per in d["mutants"].items() for det, c in per.items()}, d["controls"]


if sys.argv[1] == "junit":
    a, b = outcomes(sys.argv[2]), outcomes(sys.argv[3])
    print(f"{len(a)} tests before, {len(b)} after")
    print("only after:", *sorted(set(b) - set(a)), sep="\n  ")
    print("only before:", *sorted(set(a) - set(b)), sep="\n  ")
    print("outcome changed:", *[f"{k}: {a[k]} -> {b[k]}" for k in sorted(set(a) & set(b)) if a[k] != b[k]], sep="\n  ")
else:
    (ca, ka), (cb, kb) = cells(sys.argv[2]), cells(sys.argv[3])
    diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    for name, c in (("before", ca), ("after", cb)):
        print(name, {det: sum(v[0] for k, v in c.items() if k[1] == det) for det in ("check", "fuzz")}, "caught of",
              len({k[0] for k in c}))
    print("cells that differ:", diff or "none", "; controls equal:", ka == kb)
