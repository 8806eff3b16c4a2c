"""Data: readers (txt/jsonl/csv/tsv/parquet, gzip, folders, globs), C4-style cleaning, the memory-mapped
token store, block packing and length bucketing."""
