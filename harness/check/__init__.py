"""The check matrix: its named rows (features) and model mode's plan, the rows' order from the planted bugs they
kill, its failures grouped, its report and its progress line."""
