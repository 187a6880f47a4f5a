"""Token classification (named entities): a label and its probability for every token of a row."""
