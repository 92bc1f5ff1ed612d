"""English prose for the backbone: gensim's test texts and the Wikipedia articles of gensim's test dump.

Both ship inside the ``gensim`` package (the ``train`` extra), so the corpus is the same on every machine
without a download. The Wikipedia dump is markup; :func:`wikipedia_paragraphs` keeps only paragraphs
that read as prose (long lines ending a sentence, mostly letters), which drops infoboxes, lists, tables
and headings that the markup filter leaves behind.
"""
from __future__ import annotations

import bz2
import io
import re
from pathlib import Path

from swarm.utils.extras import install_hint

GENSIM_PROSE_FILES = (
    "lee_background.cor",
    "lee.cor",
    "crime-and-punishment.txt",
    "para2para_text1.txt",
    "para2para_text2.txt",
)
WIKIPEDIA_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_PARAGRAPH_CHARS = 120
MIN_LETTER_SHARE = 0.7

_EMPHASIS = re.compile(r"'{2,}")  # ''italic'' and '''bold'''
_EMPTY_PARENTHESES = re.compile(r"\(\s*[,;]?\s*\)")  # what a removed template leaves: "Plato ( ; 428 BC)"
_BLANKS = re.compile(r"[ \t]+")


def gensim_data(name: str) -> Path:
    try:
        from gensim.test.utils import datapath
    except ImportError as error:
        raise ModuleNotFoundError(f"the prose corpus needs gensim: {install_hint('train')}", name="gensim") from error
    return Path(datapath(name))


def gensim_texts() -> list[str]:
    """The English texts of gensim's test data, whitespace collapsed (the corpus of the first backbone)."""
    texts = [gensim_data(name).read_text(encoding="utf-8", errors="ignore") for name in GENSIM_PROSE_FILES]
    return [" ".join(text.split()) for text in texts]


def clean_paragraph(line: str) -> str:
    line = _EMPTY_PARENTHESES.sub("", _EMPHASIS.sub("", line))
    line = _BLANKS.sub(" ", line).strip()
    return line.replace(" ,", ",").replace(" .", ".").replace("( ", "(")


def is_prose(paragraph: str) -> bool:
    if len(paragraph) < MIN_PARAGRAPH_CHARS or paragraph[0] in "=*|{!:;#<" or paragraph[-1] not in ".!?\"":
        return False
    return sum(c.isalpha() for c in paragraph) >= MIN_LETTER_SHARE * len(paragraph)


def wikipedia_paragraphs() -> str:
    """The prose paragraphs of the articles (namespace 0, redirects skipped) in the dump, one per line."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    raw = bz2.open(gensim_data(WIKIPEDIA_DUMP)).read()
    articles = []
    for _title, markup, _page_id in extract_pages(io.BytesIO(raw), filter_namespaces=("0",)):
        if markup.lstrip().lower().startswith("#redirect"):
            continue
        paragraphs = [p for p in map(clean_paragraph, filter_wiki(markup).split("\n")) if is_prose(p)]
        if paragraphs:
            articles.append("\n".join(paragraphs))
    return "\n".join(articles)


def prose_sources() -> list[str]:
    """Every prose source, each kept whole so that its own tail can be held out."""
    return [*gensim_texts(), wikipedia_paragraphs()]
