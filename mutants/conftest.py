from mutants import harness


def pytest_terminal_summary(terminalreporter):
    if harness.RESULTS:
        terminalreporter.section("mutants")
        for row in harness.table(harness.RESULTS):
            terminalreporter.write_line(row)
