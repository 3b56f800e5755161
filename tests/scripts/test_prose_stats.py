import importlib.util

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "prose_stats.py"
spec = importlib.util.spec_from_file_location("prose_stats", SCRIPT)
prose_stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose_stats)


def test_sentences_end_at_stops_blank_lines_list_items_and_args():
    text = ("One two three. Four five six\nseven's sentence, across lines.\n\n"
            "- an item of four\n- another\n\nArgs:\n    name: what it is.\n>>> code()\n")
    found = prose_stats.sentences(text)
    assert found == ["One two three.", "Four five six seven's sentence, across lines.",
                     "- an item of four", "- another", "Args:", "name: what it is."]
    assert [prose_stats.words(s) for s in found] == [3, 7, 4, 1, 1, 4]


def test_markdown_prose_leaves_out_code_tables_and_headings():
    page = "# Title\n\nSome prose here.\n\n```\nnot prose at all\n```\n| a | b |\n"
    assert prose_stats.sentences(prose_stats.prose_of_markdown(page)) == ["Some prose here."]
