"""SecMM (DSMM-TBIR) logic: caption pool, DAP queries, CGDS sampling, MECF union, review and labels."""
