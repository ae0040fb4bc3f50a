"""MkDocs hook of the documentation site (mkdocs.yml): every relative link of a page must name a file of this checkout.

MkDocs checks links between pages of docs/ only; the pages also link to the records under benchmarks/results and to
README.md, which the site reaches as files of the checkout (site/ inside it, ``use_directory_urls`` off, so a link
keeps its meaning). A link whose file is missing is a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

LOG = logging.getLogger("mkdocs.hooks.docs_links")
# [text](target) and ![alt](target), outside code spans; the target up to a space, ")" or "#".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Warn for each relative link of ``page`` whose file does not exist (the markdown is returned unchanged)."""
    source = Path(page.file.abs_src_path)
    for target in _LINK.findall(_CODE.sub("", markdown)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            continue  # a URL with a scheme (https:, mailto:) or an absolute path: not a file of the checkout
        if not (source.parent / unquote(target)).exists():
            LOG.warning("%s links to %s, which is not a file of this checkout", page.file.src_uri, target)
    return markdown
