"""The window book every engine's rows are windowed in: windows open at their first row read, are
complete once closed with nothing pending, and come back in order whatever order rows finish in."""

from __future__ import annotations

from hpcinfer.job.windows import WindowBook
from hpcinfer.types import Reject


def test_windows_come_back_complete_and_in_order_whatever_order_rows_finish():
    rejected: list[Reject] = []
    book = WindowBook(3, on_reject=rejected.append)
    booked = {}
    for row in range(8):  # windows 0: rows 0-2, 1: rows 3-5, 2: rows 6-7
        window = book.window_for(row)
        window.input_rows += 1
        if row == 4:
            book.reject(window, Reject(row, "in.jsonl", row + 1, row, "invalid_json", "a bad row"))
            continue
        window.pending += 1
        booked[row] = window
    book.close()
    assert [w.window_id for w in book.complete()] == []  # nothing finished yet
    for row in (7, 6, 5, 3):  # the later windows finish first
        book.finish(booked[row], row, f"answer {row}")
    assert list(book.complete()) == []  # window 0 holds them back: the commit is in order
    for row in (2, 0, 1):
        book.finish(booked[row], row, f"answer {row}")
    done = list(book.complete())
    assert [w.window_id for w in done] == [0, 1, 2]
    assert [sorted(r for r, _ in w.results) for w in done] == [[0, 1, 2], [3, 5], [6, 7]]
    assert [len(w.rejects) for w in done] == [0, 1, 0] and rejected[0].row == 4
    assert [w.input_rows for w in done] == [3, 3, 2]
    assert not book.open


def test_a_resumed_run_opens_its_first_window_at_its_first_unread_row():
    book = WindowBook(10)
    assert book.window_for(13).first_row == 13  # rows 10-12 were committed by the run before
    assert book.window_for(20).first_row == 20 and book.open[0].closed  # the next one closes it


def test_fresh_results_are_taken_once_with_the_oldest_start():
    book = WindowBook(2, track_fresh=True)
    a, b = book.window_for(0), book.window_for(2)
    a.pending = b.pending = 2
    book.finish(a, 0, "x", started=5.0)
    book.finish(b, 2, "y", started=3.0)
    assert book.oldest_fresh() == 3.0
    taken = book.take_fresh()
    assert [(w.window_id, w.fresh) for w in taken] == [(0, [(0, "x")]), (1, [(2, "y")])]
    assert book.oldest_fresh() is None and book.take_fresh() == []
    assert a.results == [(0, "x")]  # what a checkpoint takes stays the window's for its commit


def test_a_pass_that_keeps_no_results_only_counts():
    book = WindowBook(4, keep_results=False)
    window = book.window_for(0)
    window.pending = 1
    book.finish(window, 0, "ignored")
    book.close()
    [done] = book.complete()
    assert done.results == [] and done.pending == 0
