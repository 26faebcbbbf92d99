"""Helium's workflows (helium.txt, Table 2 and Figure 2; end-to-end results in Figure 5,
Table 3, and for the composite Figures 6-7 and Tables 4-5).

- ``mapred``: ``experts`` experts with distinct roles answer each query (map), a reducer
  combines their answers.
- ``debate``: ``agents`` agents with distinct roles answer, then for ``rounds - 1`` more
  rounds each revises after reading the others' answers; a judge gives the verdict.
- ``reflect``: an expert answers, ``critics`` critics critique in parallel, the expert revises.
- ``iterative``: a summary refined chunk by chunk over each query's documents.
- ``parallel``: ``experts`` experts each read all of a query's documents (a shared prefix),
  a writer combines their views.
- ``trading``: the composite of Figure 6: analysts in parallel over the documents, a
  bull/bear debate over their reports, a risk team (map-reduce), and the trader's decision.

    python -m pipelines.helium --pipeline trading --queries 8
"""

from __future__ import annotations

from pipelines.ops import Lazy

ROLES = ("a statistician", "a software engineer", "a historian", "a lawyer", "a physician", "an economist",
         "a teacher", "a journalist", "a chemist", "a product manager", "a security analyst", "a librarian",
         "a data engineer", "an ethicist")
SYSTEM = "You are a member of an expert panel. Answer concisely and justify briefly. "
EXPERT = SYSTEM + "Question: {q}\nYou answer as {role}:"
REDUCE = SYSTEM + "Question: {q}\nThe experts answered:\n{answers}\nCombine them into one answer:"
DEBATE_OPEN = SYSTEM + "Question: {q}\nYou argue as {role}. Your answer:"
DEBATE_ROUND = (SYSTEM + "Question: {q}\nYou argue as {role}. Your previous answer: {mine}\nThe others said:\n"
                "{others}\nYour updated answer:")
JUDGE = SYSTEM + "Question: {q}\nFinal answers of the debate:\n{answers}\nThe verdict:"
CRITIC = SYSTEM + "Question: {q}\nAnswer: {a}\nYou are critic {n}. Point out one weakness:"
REVISE = SYSTEM + "Question: {q}\nYour answer: {a}\nCritiques:\n{c}\nYour revised answer:"
FIRST_CHUNK = SYSTEM + "Question: {q}\nDocument: {d}\nSummarize what it says about the question:"
NEXT_CHUNK = SYSTEM + "Question: {q}\nSummary so far: {s}\nNext document: {d}\nUpdate the summary:"
READ_ALL = "Documents:\n{docs}\n" + SYSTEM + "You are {role}. Question: {q}\nYour view:"
WRITER = SYSTEM + "Question: {q}\nViews:\n{views}\nWrite the final report:"
ANALYSTS = ("market analyst", "news analyst", "fundamentals analyst", "sentiment analyst")
RISK = ("aggressive risk manager", "neutral risk manager", "conservative risk manager")
TRADER = SYSTEM + "Case: {q}\nResearch debate:\n{debate}\nRisk assessment: {risk}\nTrader's decision (buy, hold or sell):"


def _lines(parts: dict) -> tuple[str, dict]:
    """A template fragment listing slots ``{s0}``, ``{s1}``, ... one per line, and their values."""
    return "\n".join(f"- {{{name}}}" for name in parts), parts


def mapred(inputs, ops=None, *, model: str | None = None, experts: int = 7, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    answers = {f"e{i}": ops.generate(EXPERT, q=q, role=ROLES[i % len(ROLES)], max_tokens=max_tokens)
               for i in range(experts)}
    listing, slots = _lines(answers)
    return ops.generate(REDUCE.replace("{answers}", listing), q=q, max_tokens=max_tokens, **slots)


def debate(inputs, ops=None, *, model: str | None = None, agents: int = 3, rounds: int = 2, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    roles = [ROLES[i % len(ROLES)] for i in range(agents)]
    said = [ops.generate(DEBATE_OPEN, q=q, role=r, max_tokens=max_tokens) for r in roles]
    for _ in range(rounds - 1):
        revised = []
        for i, role in enumerate(roles):
            listing, slots = _lines({f"o{j}": said[j] for j in range(agents) if j != i})
            revised.append(ops.generate(DEBATE_ROUND.replace("{others}", listing), q=q, role=role, mine=said[i],
                                        max_tokens=max_tokens, **slots))
        said = revised
    listing, slots = _lines({f"a{i}": a for i, a in enumerate(said)})
    return ops.generate(JUDGE.replace("{answers}", listing), q=q, max_tokens=max_tokens, **slots)


def reflect(inputs, ops=None, *, model: str | None = None, critics: int = 2, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    answer = ops.generate(EXPERT, q=q, role=ROLES[0], max_tokens=max_tokens)
    listing, slots = _lines({f"c{n}": ops.generate(CRITIC, q=q, a=answer, n=str(n + 1), max_tokens=max_tokens)
                             for n in range(critics)})
    return ops.generate(REVISE.replace("{c}", listing), q=q, a=answer, max_tokens=max_tokens, **slots)


def iterative(inputs, ops=None, *, model: str | None = None, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    chunks = min(len(c) for c in inputs.contexts)
    summary = ops.generate(FIRST_CHUNK, q=q, d=[c[0] for c in inputs.contexts], max_tokens=max_tokens)
    for j in range(1, chunks):
        summary = ops.generate(NEXT_CHUNK, q=q, s=summary, d=[c[j] for c in inputs.contexts], max_tokens=max_tokens)
    return summary


def parallel(inputs, ops=None, *, model: str | None = None, experts: int = 7, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    docs = ["\n".join(c) for c in inputs.contexts]
    views = {f"v{i}": ops.generate(READ_ALL, docs=docs, role=ROLES[i % len(ROLES)], q=q, max_tokens=max_tokens)
             for i in range(experts)}
    listing, slots = _lines(views)
    return ops.generate(WRITER.replace("{views}", listing), q=q, max_tokens=max_tokens, **slots)


def trading(inputs, ops=None, *, model: str | None = None, rounds: int = 2, max_tokens: int = 16):
    ops = ops or Lazy(model)
    q = inputs.questions
    docs = ["\n".join(c) for c in inputs.contexts]
    reports = {f"r{i}": ops.generate(READ_ALL, docs=docs, role=a, q=q, max_tokens=max_tokens)
               for i, a in enumerate(ANALYSTS)}
    listing, report_slots = _lines(reports)
    case = "Reports:\n" + listing + "\nCase: {q}\n"
    bull = ops.generate(case + "You are the bull researcher. Argue for buying:", q=q, max_tokens=max_tokens,
                        **report_slots)
    bear = ops.generate(case + "You are the bear researcher. Argue against buying:", q=q, max_tokens=max_tokens,
                        **report_slots)
    for _ in range(rounds - 1):
        bull, bear = (
            ops.generate(case + "Bear said: {o}\nYou are the bull researcher. Rebut:", o=bear, q=q,
                         max_tokens=max_tokens, **report_slots),
            ops.generate(case + "Bull said: {o}\nYou are the bear researcher. Rebut:", o=bull, q=q,
                         max_tokens=max_tokens, **report_slots))
    debate_listing, debate_slots = _lines({"bull": bull, "bear": bear})
    risk = {f"k{i}": ops.generate("Debate:\n" + debate_listing + "\nCase: {q}\nAs the " + role + ", assess the risk:",
                                  q=q, max_tokens=max_tokens, **debate_slots) for i, role in enumerate(RISK)}
    risk_listing, risk_slots = _lines(risk)
    risk_summary = ops.generate("Risk views:\n" + risk_listing + "\nCase: {q}\nSummarize the risk:", q=q,
                                max_tokens=max_tokens, **risk_slots)
    return ops.generate(TRADER.replace("{debate}", debate_listing), q=q, risk=risk_summary, max_tokens=max_tokens,
                        **debate_slots)


PIPELINES = {"mapred": mapred, "debate": debate, "reflect": reflect, "iterative": iterative, "parallel": parallel,
             "trading": trading}

if __name__ == "__main__":
    from pipelines import main

    main(PIPELINES)
