"""The data table (`python -m bench --table data`) in quick mode on the pretraining corpus: every row measured, its
section merged into the results file after the other tables. No timing is asserted: the machine is shared."""

from bench.__main__ import main as bench_main
from bench.data import COLUMNS, TITLE, replicate
from bench.report import MAIN_TITLE, document, merge_results


def test_replicate_writes_whole_copies_up_to_the_size(tmp_path):
    source = tmp_path / "source.jsonl"
    source.write_bytes(b'{"text": "a"}\n' * 10)
    target = replicate(source, 0.0005, tmp_path / "big.jsonl")  # 500 bytes: four copies of 140
    assert target.read_bytes() == source.read_bytes() * 4


def test_quick_data_rows_are_measured_and_merged_after_the_other_tables(tmp_path):
    output = tmp_path / "results.md"
    from bench.measure import machine_details

    main = f"## {MAIN_TITLE}\n\nthe main table\n"
    output.write_text(merge_results("", document(machine_details(), main))[0])  # measured here: kept
    report = bench_main(["--table", "data", "--quick", "--rows", "data-pretrain-*", "--output", str(output)])
    assert [row.row_id for row in report.rows] == [
        "data-pretrain-1MB-old",
        "data-pretrain-1MB-1proc",
        "data-pretrain-1MB",
    ]
    old, one, new = report.rows
    assert old.tokens == one.tokens == new.tokens > 0  # the same blocks on every path
    assert all(row.mb_per_s > 0 and row.peak_rss > 0 for row in report.rows)
    assert new.first_step[0] > new.first_step[1] > 0  # from the process start, from data loading
    text = output.read_text()
    assert text.index(f"## {TITLE}") > text.index(f"## {MAIN_TITLE}") and "the main table" in text
    assert "| " + " | ".join(COLUMNS) + " |" in text
