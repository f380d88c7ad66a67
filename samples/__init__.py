"""Sample GPT, data and scripts for zeroshard (not part of the installed package)."""
