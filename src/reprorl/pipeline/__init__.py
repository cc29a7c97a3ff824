"""The Snakemake pipeline's stages: one module per rule family, each with a `stage()` entry that
`reprorl <stage>` calls, and the evaluation, report and README block built from their outputs."""
