"""`replayllm`'s command line: main.py builds the parser; one module per subcommand holds its flags and its run."""
