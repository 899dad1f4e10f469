"""The report side: tables, figures and logs of a run's or a sweep's results.

    run_summary   a run's table.md and its terminal summary
    records       records of finished runs, aggregated over seeds and targets
    stats         paired differences with the reference and their intervals
    tables        the papers' table shapes over records
    comparisons   every algorithm against the reference: the differences'
                  intervals and the paired values behind them
    plots         the figures (learning curves, GradAlign weights, t-SNE, ...)
    metrics_log   metrics.jsonl and TensorBoard events, written at every evaluation
    origin        a report's Provenance block: the commit, data and machine
                  its runs recorded (`run.provenance`), in words

Everything here reads results (results.json's dicts) and writes files; nothing
reads a config or runs anything. Display names and paper-specific layout
(ablations, row order, the reference algorithm) come from the algorithm
registry (`algorithms.Spec`), read in `records` (and the reference's
name, `algorithms.REFERENCE`, in `tables` and `comparisons`).
"""
