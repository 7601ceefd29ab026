"""The request surface, below every other layer: errors and their codes, a request's options,
validation, results, templates and tokenization. Importing it loads no backend or kernel."""
