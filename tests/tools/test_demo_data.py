"""The demo model's training data: docstrings cut to their first paragraph, code untouched."""
from __future__ import annotations

import ast

from tools.demo_model import demo_data

SOURCE = '''"""Module summary.

Long module text.
"""


def f(x):
    """Return the thing
    over two lines.

    Parameters
    ----------
    x : int
    """
    return x


class A:
    r"""
    Summary on the next line, with a \\d raw escape.

    Details.
    """

    def g(self):
        \'\'\'One line.\'\'\'
        return "\\"\\"\\"not a docstring\\"\\"\\""
'''


def test_docstrings_keep_their_first_paragraph_and_the_code_stays():
    trimmed = demo_data.trim_docstrings(SOURCE)
    tree, original = ast.parse(trimmed), ast.parse(SOURCE)
    docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))]
    assert docs == ["Module summary.", "Return the thing\nover two lines.",
                    "Summary on the next line, with a \\d raw escape.", "One line."]
    code = lambda t: [ast.dump(n) for n in ast.walk(t) if isinstance(n, ast.Return)]  # noqa: E731
    assert code(tree) == code(original)
    assert "Parameters" not in trimmed and "Details" not in trimmed


def test_text_that_does_not_parse_is_left_as_it_is():
    broken = 'def f(:\n    """Doc.\n\n    More.\n    """\n'
    assert demo_data.trim_docstrings(broken) == broken
