"""Command-line tools: ls-fairseq-convert, ls-fairseq-compare, ls-fairseq-quickstart."""
